"""Keeping the prefill/decode mix matched to the traffic (DESIGN 4, the P/D ratio planner).

Every ``interval_s``::

    pressure = pressure_of(view, mean prompt tokens)     e.g. SloGoodput.pressure
    flip = planner.decide(now, pressure, n_prefill, n_decode)   at most one, hysteresis
    pick the least busy worker of the role giving one up
    controller.set_role(worker, new role)                 drains it first, then flips

The planner is pure (router/); this loop only observes and applies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.planner import Flip, RatioPlanner, RolePressure
from router.types import ClusterView, Role, WorkerView
from services.cluster.controller import Controller
from services.metrics import BatonMetrics

__all__ = ["PressureFn", "Rebalancer"]

log = logging.getLogger(__name__)

PressureFn = Callable[[ClusterView, float], RolePressure]

_FLIPS = {
    Flip.DECODE_TO_PREFILL: (Role.DECODE, Role.PREFILL),
    Flip.PREFILL_TO_DECODE: (Role.PREFILL, Role.DECODE),
}


class Rebalancer:
    def __init__(
        self,
        controller: Controller,
        view: Callable[[], ClusterView],
        pressure_of: PressureFn,
        planner: RatioPlanner,
        metrics: BatonMetrics,
        mean_prompt_tokens: Callable[[], float],
    ) -> None:
        self._controller = controller
        self._view = view
        self._pressure_of = pressure_of
        self._planner = planner
        self._metrics = metrics
        self._mean_prompt_tokens = mean_prompt_tokens

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self._planner.interval_s)
            try:
                await self.tick()
            except Exception:  # a failed flip must not stop future ones
                log.exception("rebalance tick failed")

    async def tick(self) -> tuple[str, Role] | None:
        """Decide once; apply a flip if the planner asks for one. Returns (worker, new role)."""
        view = self._view()
        prefill, decode = view.by_role(Role.PREFILL), view.by_role(Role.DECODE)
        pressure = self._pressure_of(view, self._mean_prompt_tokens())
        flip = self._planner.decide(time.monotonic(), pressure, len(prefill), len(decode))
        if flip is Flip.NONE:
            return None
        source, target = _FLIPS[flip]
        worker = _least_busy(prefill if source is Role.PREFILL else decode)
        log.info(
            "flipping %s from %s to %s (prefill pressure %.2f, decode pressure %.2f)",
            worker.worker_id,
            source,
            target,
            pressure.prefill,
            pressure.decode,
        )
        await self._controller.set_role(worker.worker_id, target)
        self._metrics.role_changes.labels(source.value, target.value).inc()
        return worker.worker_id, target


def _least_busy(workers: tuple[WorkerView, ...]) -> WorkerView:
    return min(workers, key=lambda w: (len(w.running), sum(w.queued_tokens.values())))
