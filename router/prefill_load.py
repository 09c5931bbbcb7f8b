"""The prefill pool's utilisation from what was placed on it, as role pressure.

A prefill queue's predicted TTFT (the policy's pressure) rises only once the queue has
built up, seconds after the pool became too small: when a prefill-heavy phase started,
the planner saw prefill at a tenth of its target while arrivals already needed more
prefill seconds per second than the pool had (``benchmarks/policies.py``, phase shift).
``PrefillLoad`` keeps the prefill seconds (by the cost model) of the disaggregated plans
placed in the last ``window_s`` and reports the pool's utilisation
``u = Σ prefill_s / (window × prefill workers)``; ``raise_pressure`` lifts prefill
pressure to ``u / max_utilization`` when that is higher, so a pool loaded at
``max_utilization`` reads as exactly at target (the utilisation
``router.planner.plan_pools`` sizes prefill pools for).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from router.planner import RolePressure

__all__ = ["PrefillLoad"]


class PrefillLoad:
    def __init__(self, window_s: float, max_utilization: float = 0.8) -> None:
        if window_s <= 0 or not 0 < max_utilization <= 1:
            raise ValueError("need window_s > 0 and 0 < max_utilization <= 1")
        self.window_s = window_s
        self.max_utilization = max_utilization
        self._placed: deque[tuple[float, float]] = deque()  # (when, prefill seconds)
        self._sum_s = 0.0
        self._first_s: float | None = None
        self._now_s = 0.0

    def placed(self, now_s: float, prefill_s: float) -> None:
        """A disaggregated plan: ``prefill_s`` of work on the prefill pool."""
        if self._first_s is None:
            self._first_s = now_s
        self._now_s = max(self._now_s, now_s)
        self._placed.append((now_s, prefill_s))
        self._sum_s += prefill_s
        self._trim()

    def utilization(self, num_prefill: int, now_s: float | None = None) -> float:
        """Prefill seconds placed per second of the window, per prefill worker (``now_s``:
        the window ends then, else at the latest placement)."""
        if now_s is not None:
            self._now_s = max(self._now_s, now_s)
        self._trim()
        if self._first_s is None or num_prefill <= 0:
            return 0.0
        # Before a whole window has passed, per second of what has passed (at least a
        # tenth of the window, so that the first request alone is not a full pool).
        span_s = min(self.window_s, max(0.1 * self.window_s, self._now_s - self._first_s))
        return self._sum_s / (span_s * num_prefill)

    def raise_pressure(
        self, pressure: RolePressure, num_prefill: int, now_s: float | None = None
    ) -> RolePressure:
        lifted = self.utilization(num_prefill, now_s) / self.max_utilization
        if lifted <= pressure.prefill:
            return pressure
        return dataclasses.replace(pressure, predicted_ttft_s=lifted * pressure.ttft_target_s)

    def _trim(self) -> None:
        horizon = self._now_s - self.window_s
        while self._placed and self._placed[0][0] < horizon:
            self._sum_s -= self._placed.popleft()[1]
        if not self._placed:
            self._sum_s = 0.0
