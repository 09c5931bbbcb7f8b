"""The P/D ratio loop: the router's planner decides, the controller drains and flips a worker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.planner import RatioPlanner, RolePressure
from router.types import ClusterView, Role
from services.cluster.rebalance import Rebalancer

pytestmark = pytest.mark.asyncio


def pressure(prefill: float, decode: float) -> RolePressure:
    return RolePressure(
        predicted_ttft_s=prefill, ttft_target_s=1.0, decode_peak_fraction=decode,
        predicted_tpot_s=0.0, tpot_target_s=1.0,
    )  # fmt: skip


async def test_prefill_pressure_flips_one_decode_worker_and_never_empties_a_pool(
    gateway: Any,
) -> None:
    svc, _ = await gateway(**{"workers.prefill": 2, "workers.decode": 2})
    current = pressure(prefill=5.0, decode=0.1)

    def pressure_of(view: ClusterView, mean_prompt_tokens: float) -> RolePressure:
        return current

    rebalancer = Rebalancer(
        svc.controller, svc.router.view, pressure_of, RatioPlanner(interval_s=0.0),
        svc.metrics, lambda: 100.0,
    )  # fmt: skip
    flipped = await rebalancer.tick()
    assert flipped is not None and flipped[1] is Role.PREFILL
    worker_id = flipped[0]
    assert worker_id.startswith("decode") and svc.controller.workers()[worker_id] is Role.PREFILL
    await asyncio.sleep(0.05)  # the worker publishes its new role
    roles = [s.role for s in svc.router.reports().values()]
    assert roles.count(Role.PREFILL) == 3 and roles.count(Role.DECODE) == 1
    assert svc.metrics.role_changes.labels("decode", "prefill")._value.get() == 1
    # The last decode worker is never given to prefill: it becomes mixed (still decodes).
    flipped = await rebalancer.tick()
    assert flipped is not None and flipped[1] is Role.MIXED and flipped[0].startswith("decode")
    await asyncio.sleep(0.05)
    roles = [s.role for s in svc.router.reports().values()]
    assert roles.count(Role.PREFILL) == 3 and roles.count(Role.MIXED) == 1

    current = RolePressure(1.0, 1.0, 1.05, 0.0, 1.0, mixed_ttft_s=1.0, mixed_tpot_s=1.05)
    assert await rebalancer.tick() is None  # within hysteresis: leave it alone


async def test_slo_goodput_gets_a_rebalancer_round_robin_does_not(gateway: Any) -> None:
    svc, _ = await gateway(**{"router.policy": "slo_goodput"})
    assert svc.rebalancer is not None
    plain, _ = await gateway()
    assert plain.rebalancer is None


async def test_a_worker_that_keeps_its_role_is_not_counted_nor_asked_again(gateway: Any) -> None:
    svc, _ = await gateway(**{"workers.prefill": 2, "workers.decode": 2})
    asked: list[str] = []

    class OneWorkerKeepsItsRole:
        """The controller, except that the first worker asked keeps its role (as a
        fixed-role worker does)."""

        async def set_role(self, worker_id: str, role: Role) -> Role:
            asked.append(worker_id)
            if worker_id == asked[0]:
                return svc.controller.workers()[worker_id]
            return await svc.controller.set_role(worker_id, role)

    rebalancer = Rebalancer(
        OneWorkerKeepsItsRole(), svc.router.view, lambda v, n: pressure(5.0, 0.1),  # type: ignore[arg-type]
        RatioPlanner(interval_s=60.0), svc.metrics, lambda: 100.0,
    )  # fmt: skip
    assert await rebalancer.tick() is None
    assert svc.metrics.role_changes.labels("decode", "prefill")._value.get() == 0
    # At once (the refused flip took no interval), and another decode worker.
    flipped = await rebalancer.tick()
    assert flipped is not None and flipped == (asked[1], Role.PREFILL) and asked[1] != asked[0]
    assert svc.metrics.role_changes.labels("decode", "prefill")._value.get() == 1
