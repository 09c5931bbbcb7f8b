"""LLMEngine on the built-in tiny model: prefix cache, disaggregation hooks, seeds, stops, errors."""

from __future__ import annotations

import time

import pytest
import torch

from services.engine.messages import (
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    NoRoomError,
    SamplingParams,
)
from tests.unit.engine.engine_helpers import greedy, make_engine, run_all, serve, tokens_of

BS = 4


def prompt(n: int, start: int = 10) -> tuple[int, ...]:
    return tuple((start + 7 * i) % 200 + 3 for i in range(n))


# -- prefix caching -----------------------------------------------------------------


def test_shared_prefix_computes_only_the_rest_and_gives_identical_output() -> None:
    shared = prompt(3 * BS)
    a = EngineRequest("a", (*shared, 1, 2), greedy(8))
    b = EngineRequest("b", (*shared, 9, 9, 9), greedy(8))
    engine = make_engine(block_size=BS)
    serve(engine, [a])
    before = engine.stats()
    engine.add_request(b)
    outs = run_all(engine)["b"]
    after = engine.stats()
    assert outs[-1].num_cached_tokens == 3 * BS
    assert after.num_prefix_hit_tokens - before.num_prefix_hit_tokens == 3 * BS
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 3
    reference = serve(make_engine(block_size=BS, enable_prefix_caching=False), [b])
    assert tokens_of(outs) == reference["b"]


def test_prefix_caching_off_recomputes_everything() -> None:
    engine = make_engine(block_size=BS, enable_prefix_caching=False)
    serve(engine, [EngineRequest("a", prompt(13), greedy(2))])
    out = run_all_one(engine, EngineRequest("b", prompt(13), greedy(2)))
    assert out[-1].num_cached_tokens == 0
    assert engine.stats().num_prefix_hit_tokens == 0


def run_all_one(engine, request):  # type: ignore[no-untyped-def]
    engine.add_request(request)
    return run_all(engine)[request.request_id]


# -- disaggregation: prefill-only on A, adopt on B ----------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        greedy(12),
        SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=77, ignore_eos=True),
        SamplingParams(
            max_tokens=12, temperature=1.0, seed=5, presence_penalty=1.5, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded", "seeded_penalty"],
)
def test_prefill_on_a_then_adopt_on_b_equals_serving_on_a(sampling: SamplingParams) -> None:
    p = prompt(11)
    reference = serve(make_engine(block_size=BS), [EngineRequest("ref", p, sampling)])["ref"]

    a, b = make_engine(block_size=BS), make_engine(block_size=BS)
    a.add_request(EngineRequest("x", p, sampling, prefill_only=True))
    (first,) = run_all(a)["x"]
    assert first.finish_reason is FinishReason.PREFILLED
    held = first.held_kv
    assert held is not None and held.num_tokens == len(p)
    assert len(held.block_ids) == -(-len(p) // BS)
    assert a.stats().num_held_blocks == len(held.block_ids)

    block_ids = b.adopt(EngineRequest("x", p, sampling, output_token_ids=first.new_token_ids))
    assert len(block_ids) == len(held.block_ids)
    # The "transfer": copy the held blocks' bytes into the blocks B handed out.
    b.kv_storage[torch.tensor(block_ids)] = a.kv_storage[torch.tensor(held.block_ids)]
    a.release_held("x")
    assert a.stats().num_held_blocks == 0
    b.start_adopted("x")
    rest = run_all(b)["x"]
    assert [*first.new_token_ids, *tokens_of(rest)] == reference
    assert rest[-1].num_output_tokens == 12
    assert rest[-1].finish_reason is FinishReason.LENGTH


def test_adopt_refuses_what_does_not_fit_and_abort_frees_adopted_blocks() -> None:
    engine = make_engine(block_size=BS, kv_cache_bytes=4 * 2 * 2 * 2 * BS * 16 * 4)
    assert engine.stats().num_total_blocks == 4
    big = EngineRequest("big", prompt(20), greedy(4), output_token_ids=(5,))
    with pytest.raises(NoRoomError) as no_room:  # capacity, re-placed; never a 400
        engine.adopt(big)
    assert not isinstance(no_room.value, InvalidRequestError)
    assert engine.stats().num_free_blocks == 4
    ids = engine.adopt(EngineRequest("ok", prompt(8), greedy(4), output_token_ids=(5,)))
    assert len(ids) == 2 and engine.stats().num_free_blocks == 2
    engine.abort("ok")
    assert engine.stats().num_free_blocks == 4
    with pytest.raises(InvalidRequestError):
        engine.start_adopted("ok")


# -- seeded sampling ------------------------------------------------------------------


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch() -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    target = EngineRequest("t", prompt(9), seeded)
    alone = serve(make_engine(block_size=BS), [target])["t"]
    others = [
        EngineRequest(
            f"o{i}", prompt(3 + 5 * i, start=i), SamplingParams(max_tokens=20, ignore_eos=True)
        )
        for i in range(7)
    ]
    busy = serve(
        make_engine(block_size=BS, max_num_batched_tokens=12), [*others[:4], target, *others[4:]]
    )
    assert busy["t"] == alone
    # Sanity: the sampling really was random (a different seed gives different tokens).
    other_seed = EngineRequest(
        "u", prompt(9), SamplingParams(max_tokens=16, seed=43, ignore_eos=True)
    )
    assert serve(make_engine(block_size=BS), [other_seed])["u"] != alone


# -- stops ----------------------------------------------------------------------------


def test_max_tokens_min_tokens_and_stop_token_ids() -> None:
    engine = make_engine(block_size=BS)
    free_run = serve(engine, [EngineRequest("f", prompt(6), greedy(10))])["f"]
    stop_at = free_run[3]
    outs = run_all_one(engine, EngineRequest("s", prompt(6), greedy(10, stop_token_ids=(stop_at,))))
    first_hit = free_run.index(stop_at)
    assert tokens_of(outs) == free_run[: first_hit + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    # min_tokens: the stop id cannot end the request before min_tokens outputs.
    outs = run_all_one(
        engine,
        EngineRequest(
            "m", prompt(6), greedy(10, stop_token_ids=(stop_at,), min_tokens=first_hit + 2)
        ),
    )
    assert len(tokens_of(outs)) >= first_hit + 2
    outs = run_all_one(engine, EngineRequest("l", prompt(6), greedy(3)))
    assert len(tokens_of(outs)) == 3 and outs[-1].finish_reason is FinishReason.LENGTH
    assert [o.num_output_tokens for o in outs] == [1, 2, 3]


def test_generation_stops_with_length_at_the_context_limit() -> None:
    engine = make_engine(block_size=BS, max_model_len=20)
    outs = run_all_one(engine, EngineRequest("c", prompt(15), greedy(100)))
    assert len(tokens_of(outs)) == 5
    assert outs[-1].finish_reason is FinishReason.LENGTH


# -- bad inputs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (EngineRequest("e", (), greedy(4)), "prompt"),
        (EngineRequest("e", prompt(40), greedy(4)), "prompt"),
        (EngineRequest("e", prompt(4), SamplingParams(max_tokens=0)), "max_tokens"),
        (EngineRequest("e", prompt(4), SamplingParams(max_tokens=-3)), "max_tokens"),
        (EngineRequest("e", (1, 2, 10**6), greedy(4)), "prompt"),
        (EngineRequest("e", prompt(4), SamplingParams(temperature=5.0)), "temperature"),
        (
            EngineRequest("e", prompt(4), greedy(4, stop_token_ids=(10**6,), min_tokens=2)),
            "stop_token_ids",
        ),
    ],
    ids=[
        "empty",
        "too_long",
        "zero_max_tokens",
        "negative_max_tokens",
        "bad_token",
        "temperature",
        "bad_stop_token",
    ],
)
def test_bad_inputs_raise_and_the_engine_keeps_serving(request_: EngineRequest, param: str) -> None:
    engine = make_engine(block_size=BS, max_model_len=32)
    engine.add_request(EngineRequest("good", prompt(5), greedy(6)))
    engine.step()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request_)
    assert info.value.param == param
    outs = run_all(engine)
    assert set(outs) == {"good"} and len(tokens_of(outs["good"])) == 5
    # The rejected id is free to use again.
    assert serve(engine, [EngineRequest("e", prompt(4), greedy(2))])["e"]


def test_duplicate_request_id_is_rejected() -> None:
    engine = make_engine(block_size=BS)
    engine.add_request(EngineRequest("d", prompt(4), greedy(2)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(EngineRequest("d", prompt(4), greedy(2)))


# -- abort and stats ------------------------------------------------------------------


def test_abort_frees_blocks_and_stats_track_the_step() -> None:
    engine = make_engine(block_size=BS)
    total = engine.stats().num_total_blocks
    engine.add_request(EngineRequest("a", prompt(9), greedy(50)))
    engine.add_request(EngineRequest("b", prompt(5), greedy(50)))
    before_s = time.monotonic()
    engine.step()
    engine.step()
    after_s = time.monotonic()
    s = engine.stats()
    assert {r.request_id for r in s.running} == {"a", "b"}
    ends = [step.end_s for step in s.recent_steps]
    assert before_s < ends[0] < ends[1] <= after_s  # stamped by the engine, in order
    assert s.recent_steps[0].num_prefill_tokens == 14
    assert s.recent_steps[1].num_decode_seqs == 2
    assert s.recent_steps[1].total_context_tokens == 10 + 6
    engine.abort("a")
    engine.abort("b")
    assert not engine.has_unfinished()
    s = engine.stats()
    assert s.num_free_blocks == total and s.running == ()


# -- text, stop strings, logprobs -------------------------------------------------------


def seeded(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=1, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_stop_strings_are_the_gateways_the_engine_ships_token_ids_only() -> None:
    """One owner for text: the engine neither detokenizes nor matches stop strings (the
    gateway does, and aborts the request), so a stop string changes nothing here."""
    engine = make_engine(block_size=BS)
    p = tuple(engine.encode("Once upon a time"))
    free = run_all_one(engine, EngineRequest("free", p, seeded()))
    text = engine.decode(tokens_of(free))
    stop = text[3:5]
    assert stop
    outs = run_all_one(engine, EngineRequest("s", p, seeded(stop=(stop,))))
    assert tokens_of(outs) == tokens_of(free)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert not any(hasattr(o, "new_text") for o in outs)


def test_logprobs_are_reported_only_when_asked() -> None:
    engine = make_engine(block_size=BS)
    engine.add_request(EngineRequest("lp", prompt(5), greedy(3, logprobs=2)))
    engine.add_request(EngineRequest("no", prompt(5), greedy(3)))
    outs = run_all(engine)
    for o in outs["lp"]:
        assert o.logprobs is not None and len(o.logprobs) == 1
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] and len(lp.top) == 2
        # Greedy picks the most likely token: its logprob is the best of the top list.
        assert lp.logprob >= lp.top[0][1] - 1e-6
    assert all(o.logprobs is None for o in outs["no"])


def test_adopted_request_survives_preemption_with_the_same_tokens() -> None:
    p = prompt(10)
    reference = serve(make_engine(block_size=BS), [EngineRequest("x", p, greedy(30))])["x"]
    # 10 blocks of 4: x (up to 40 tokens) competes with an older request and is preempted.
    engine = make_engine(
        block_size=BS, kv_cache_bytes=10 * 2 * 2 * 2 * BS * 16 * 4, admission="blocks"
    )
    engine.add_request(EngineRequest("old", prompt(6, start=90), greedy(30)))
    engine.step()
    ids = engine.adopt(EngineRequest("x", p, greedy(30), output_token_ids=(reference[0],)))
    prefill = make_engine(block_size=BS)
    prefill.add_request(EngineRequest("x", p, greedy(30), prefill_only=True))
    (first,) = run_all(prefill)["x"]
    assert first.held_kv is not None
    engine.kv_storage[torch.tensor(ids)] = prefill.kv_storage[torch.tensor(first.held_kv.block_ids)]
    engine.start_adopted("x")
    outs = run_all(engine)
    assert engine.stats().num_preemptions > 0
    assert [reference[0], *tokens_of(outs["x"])] == reference
