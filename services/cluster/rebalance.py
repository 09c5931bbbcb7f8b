"""Keeping the prefill/decode mix matched to the traffic (DESIGN 4, the P/D ratio planner).

Every ``interval_s``::

    pressure = pressure_of(view, mean prompt tokens)     e.g. SloGoodput.pressure
    flip = choose_flip(view, pressure, planner, now)   at most one, hysteresis; the
                                                       least busy of the role giving one up
    controller.set_role(worker, new role)              drains it first, then flips

The decision is pure (router/planner.py; the simulator applies the same one); this
loop only observes and applies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.planner import RatioPlanner, RolePressure, choose_flip
from router.types import ClusterView, Role
from services.cluster.controller import Controller
from services.metrics import BatonMetrics

__all__ = ["PressureFn", "Rebalancer"]

log = logging.getLogger(__name__)

PressureFn = Callable[[ClusterView, float], RolePressure]


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
        pressure = self._pressure_of(view, self._mean_prompt_tokens())
        flip = choose_flip(view, pressure, self._planner, time.monotonic())
        if flip is None:
            return None
        log.info(
            "flipping %s from %s to %s (pressure: prefill %.2f, decode %.2f, "
            "mixed TTFT %.2f, mixed TPOT %.2f)",
            flip.worker_id,
            flip.source,
            flip.target,
            pressure.prefill,
            pressure.decode,
            pressure.mixed_ttft,
            pressure.mixed_tpot,
        )
        now = await self._controller.set_role(flip.worker_id, flip.target)
        if now is not flip.target:
            log.info("%s keeps its role (%s)", flip.worker_id, now)
            self._planner.refused(flip.worker_id, flip.target)
            return None
        self._metrics.role_changes.labels(flip.source.value, flip.target.value).inc()
        return flip.worker_id, flip.target
