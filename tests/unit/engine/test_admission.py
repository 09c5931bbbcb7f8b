"""The past-future estimator as the engine's admission rule (router issue).

Same workload, same tiny model, same small KV pool: one engine admits on the
blocks free now, the other on the estimated future peak. Both must produce the
same greedy tokens; the estimator-admitted one must preempt fewer requests.
"""

from __future__ import annotations

import random

import pytest

from router.estimator import PastFutureAdmission
from services.backends import make_engine
from services.config import EngineConfig, ModelConfig
from services.engine.messages import EngineRequest, SamplingParams

BLOCK_BYTES_TINY = 8192  # 2 layers x 2 x 2 heads x 16 tokens x 16 dims x 4 bytes


def _workload(seed: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(24):
        prompt = tuple(rng.randrange(0, 256) for _ in range(rng.randint(16, 40)))
        max_tokens = rng.choice((24, 48, 96, 160))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests.append(EngineRequest(f"r{i}", prompt, sampling))
    return requests


def _serve(
    admission: str, requests: list[EngineRequest]
) -> tuple[dict[str, list[int]], int, object]:
    cfg = EngineConfig(
        device="cpu",
        kv_cache_bytes=40 * BLOCK_BYTES_TINY,  # 640 tokens: far less than the workload's peak
        max_num_seqs=24,
        admission=admission,  # type: ignore[arg-type]
        enable_prefix_caching=False,
    )
    engine = make_engine("embedded", ModelConfig(), cfg)
    policy = engine.scheduler.admission  # type: ignore[attr-defined]
    if isinstance(policy, PastFutureAdmission):
        # A worker that has been serving this traffic: its history holds these lengths.
        for seed in range(100, 109):  # 216 finishes: the whole window, the prior washed out
            for r in _workload(seed):
                policy.observe_finished(r.sampling.max_tokens)
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished(), "workload did not drain"
    return tokens, engine.stats().num_preemptions, policy


@pytest.mark.slow
def test_estimator_admission_preempts_less_than_free_block_admission() -> None:
    requests = _workload(seed=1)
    tokens_blocks, preempt_blocks, _ = _serve("blocks", requests)
    tokens_pf, preempt_pf, policy = _serve("past_future", requests)

    assert tokens_pf == tokens_blocks  # admission order never changes greedy tokens
    assert all(len(tokens_pf[r.request_id]) == r.sampling.max_tokens for r in requests)
    assert preempt_blocks > 0, (
        "the workload must overflow the pool for the comparison to mean anything"
    )
    assert preempt_pf < preempt_blocks
    assert isinstance(policy, PastFutureAdmission)
    assert policy.num_mispredictions == preempt_pf  # every exhaustion is counted


def test_past_future_is_the_default_and_blocks_is_selectable() -> None:
    engine = make_engine(
        "embedded", ModelConfig(), EngineConfig(device="cpu", kv_cache_bytes=64 * BLOCK_BYTES_TINY)
    )
    assert isinstance(engine.scheduler.admission, PastFutureAdmission)  # type: ignore[attr-defined]
    engine = make_engine(
        "embedded",
        ModelConfig(),
        EngineConfig(device="cpu", kv_cache_bytes=64 * BLOCK_BYTES_TINY, admission="blocks"),
    )
    assert not isinstance(engine.scheduler.admission, PastFutureAdmission)  # type: ignore[attr-defined]


def test_finished_output_lengths_feed_the_estimator_history() -> None:
    engine = make_engine(
        "embedded", ModelConfig(), EngineConfig(device="cpu", kv_cache_bytes=64 * BLOCK_BYTES_TINY)
    )
    policy = engine.scheduler.admission  # type: ignore[attr-defined]
    version = policy.history.version
    engine.add_request(
        EngineRequest(
            "a", (1, 2, 3), SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
        )
    )
    while engine.has_unfinished():
        engine.step()
    assert policy.history.version == version + 1
    assert 7 in policy.history.sorted_lengths()
