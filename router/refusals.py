"""What the front door refused, as role pressure the ratio planner can see.

A role's pressure from the cluster view (queues, KV, step times) stays low while
admission keeps the queues short by refusing what would miss: the overload is in the
refusals, not in the view. ``RefusalMeter`` keeps the decisions of the last
``window_s`` and reports, per role, the share of requests refused for that role's
reason (a TTFT miss is prefill's; decode memory or TPOT is decode's); ``raise_pressure``
lifts a role's pressure to ``1 + share`` when that is higher, so a role refusing a
tenth of the traffic reads as 1.1× its target.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from router.planner import RolePressure

__all__ = ["RefusalMeter"]

_PREFILL_REASONS = ("ttft",)
_DECODE_REASONS = ("decode", "tpot", "memory")


class RefusalMeter:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._decisions: deque[tuple[float, str]] = deque()  # (when, "" or the reason)
        self._now_s = 0.0

    def placed(self, now_s: float) -> None:
        self._add(now_s, "")

    def refused(self, now_s: float, reason: str) -> None:
        self._add(now_s, reason)

    def shares(self, now_s: float | None = None) -> tuple[float, float]:
        """(prefill, decode): the shares of the window's requests refused for each
        (``now_s``: the window ends then, else at the latest decision; with no traffic
        the refusals age out as time passes, they are not held until the next one)."""
        if now_s is not None:
            self._now_s = max(self._now_s, now_s)
        self._trim()
        n = len(self._decisions)
        if not n:
            return 0.0, 0.0
        prefill = sum(1 for _, r in self._decisions if any(k in r for k in _PREFILL_REASONS))
        decode = sum(1 for _, r in self._decisions if any(k in r for k in _DECODE_REASONS))
        return prefill / n, decode / n

    def raise_pressure(self, pressure: RolePressure, now_s: float | None = None) -> RolePressure:
        prefill, decode = self.shares(now_s)
        if not (prefill or decode):
            return pressure
        p = pressure
        ttft_s = max(p.predicted_ttft_s, (1.0 + prefill) * p.ttft_target_s) if prefill else None
        tpot_s = max(p.predicted_tpot_s, (1.0 + decode) * p.tpot_target_s) if decode else None
        return dataclasses.replace(
            p,
            predicted_ttft_s=p.predicted_ttft_s if ttft_s is None else ttft_s,
            predicted_tpot_s=p.predicted_tpot_s if tpot_s is None else tpot_s,
        )

    def _add(self, now_s: float, reason: str) -> None:
        self._now_s = max(self._now_s, now_s)
        self._decisions.append((now_s, reason))
        self._trim()

    def _trim(self) -> None:
        horizon = self._now_s - self.window_s
        while self._decisions and self._decisions[0][0] < horizon:
            self._decisions.popleft()
