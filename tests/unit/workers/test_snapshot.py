"""The telemetry snapshot carries what the router prices a worker's queue with: the step
budget, the long-prefill threshold and every prompt token still to compute."""

from __future__ import annotations

from router.types import Role
from services.engine.messages import EngineRequest
from services.workers.telemetry import LoopState, build_snapshot
from tests.unit.engine.engine_helpers import greedy, make_engine


def test_snapshot_reports_the_step_budget_and_the_long_prefill_threshold() -> None:
    engine = make_engine(max_num_batched_tokens=48, long_prefill_token_threshold=16)
    for i in range(2):
        engine.add_request(EngineRequest(f"r{i}", tuple(range(1, 41)), greedy(2)))
    engine.step()  # two 40-token prompts share a 48-token step: 16 tokens each, then 16
    loop = LoopState("p0", Role.PREFILL, False, 1, 0, 0, 64)
    snap = build_snapshot(engine, loop)
    assert snap.prefill_budget_tokens == 48
    assert snap.long_prefill_tokens == 16
    # Each request computed one chunk, not a whole prompt; the rest is still to compute.
    assert sorted(r.num_tokens_held for r in snap.running) == [16, 16]
    assert snap.waiting_prompt_lens == (24, 24)
    assert build_snapshot(make_engine(), loop).long_prefill_tokens == 0
