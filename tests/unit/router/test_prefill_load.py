"""router.prefill_load: a prefill pool loaded past its utilisation target reaches the
planner before its queue has built up."""

from __future__ import annotations

import pytest

from router.front_door import Router, RouterSettings
from router.planner import Flip, RatioPlanner, RolePressure
from router.prefill_load import PrefillLoad
from router.types import Plan, RequestProfile, Role
from services.workers.messages import WorkerSnapshot
from tests.unit.router.builders import PROFILE, SLO_DEFAULT

QUIET = RolePressure(0.1, 1.0, 0.2, 0.01, 0.05)  # prefill 0.1, decode 0.2


def test_a_pool_loaded_at_its_target_utilisation_reads_as_at_target() -> None:
    load = PrefillLoad(window_s=10.0, max_utilization=0.8)
    for i in range(41):  # 0.4 prefill seconds a second, over 10 s, on 2 workers
        load.placed(i * 0.25, 0.1)
    assert load.utilization(2) == pytest.approx(0.205, rel=0.01)
    assert load.raise_pressure(QUIET, 1).prefill == pytest.approx(0.41 / 0.8, rel=0.01)
    assert load.raise_pressure(QUIET, 8) == QUIET  # lower than the queue's own: unchanged


def test_placements_leave_the_window_as_time_passes_without_traffic() -> None:
    load = PrefillLoad(window_s=5.0)
    load.placed(0.0, 1.0)
    assert load.utilization(1, now_s=0.0) == pytest.approx(2.0)  # a tenth of the window
    assert load.utilization(1, now_s=2.0) == pytest.approx(0.5)
    assert load.raise_pressure(QUIET, 1, now_s=6.0) == QUIET


def _snapshot(worker_id: str, role: Role) -> WorkerSnapshot:
    return WorkerSnapshot(
        worker_id=worker_id, role=role, draining=False, seq=1, time_s=1.0, block_size=16,
        num_total_blocks=1000, num_free_blocks=1000, num_cached_blocks=0, num_held_blocks=0,
        running=(), waiting_prompt_lens=(), recent_steps=(), recent_output_lens=(),
        num_preemptions=0, num_pending_pulls=0, num_finished_requests=0,
        kv_bytes_per_token=100_000, max_num_seqs=64, max_model_len=4096,
    )  # fmt: skip


def test_a_prefill_heavy_burst_flips_a_decode_worker_before_any_queue_shows_it() -> None:
    # PROFILE: a 490-token prompt prefills in 0.01 + 1e-4 × 490 = 0.059 s. 20 a second on
    # 1 prefill worker: utilisation 1.18, pressure 1.47 against 0.8; the queue in the
    # view is empty (the prefill worker's telemetry has not caught up).
    settings = RouterSettings(
        profile=PROFILE, default_slo=SLO_DEFAULT, length_split="temporal", colocate_roles=(),
        rebalance_interval_s=1.0,
    )  # fmt: skip
    r = Router(settings)
    r.update(_snapshot("p", Role.PREFILL))
    for d in ("d1", "d2", "d3"):
        r.update(_snapshot(d, Role.DECODE))
    for i in range(20):
        now = i * 0.05
        plan = r.place(RequestProfile(f"r{i}", 490, 490, max_tokens=10, arrival_s=now), now)
        assert isinstance(plan, Plan) and plan.decode_worker is not None
        r.release(f"r{i}")  # done: the view shows no queue at all
    pressure = r.pressure(1.0)
    assert pressure is not None and pressure.prefill == pytest.approx(1.18 / 0.8, rel=0.02)
    assert RatioPlanner(interval_s=1.0).decide(1.0, pressure, 1, 3) is Flip.DECODE_TO_PREFILL
    pressure = r.pressure(10.0)  # no traffic since: nothing to move for
    assert pressure is not None and pressure.prefill < 1.0
