"""The Engine protocol's contract, run against every implementation by backend name.

Adding an implementation to the contract is one line in ``BACKENDS_UNDER_TEST``
(it must also be registered in ``services.backends.BACKENDS``).
"""

from __future__ import annotations

import pytest
import torch

from services.backends import make_engine
from services.backends.protocol import Engine
from services.config import EngineConfig, ModelConfig
from services.engine.messages import (
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)

BACKENDS_UNDER_TEST = [
    "embedded",
]

BLOCK_SIZE = 4


def build(backend: str) -> Engine:
    cfg = EngineConfig(
        device="cpu", block_size=BLOCK_SIZE, kv_cache_bytes=2**20, max_model_len=64, num_threads=1
    )
    return make_engine(backend, ModelConfig(name="tiny", seed=0), cfg)


@pytest.fixture(params=BACKENDS_UNDER_TEST)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine never became idle")


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def prompt_of(engine: Engine, text: str = "The quick brown fox") -> tuple[int, ...]:
    return tuple(engine.encode(text))


def test_is_an_engine(backend: str) -> None:
    engine = build(backend)
    assert isinstance(engine, Engine)
    info = engine.model_info
    assert info.max_model_len <= 64 and info.vocab_size > 0
    assert engine.kv_layout.block_size == BLOCK_SIZE


def test_runs_to_max_tokens_with_deltas(backend: str) -> None:
    engine = build(backend)
    p = prompt_of(engine)
    engine.add_request(EngineRequest("a", p, greedy(7)))
    outs = run(engine)["a"]
    assert len(tokens(outs)) == 7
    assert [o.num_output_tokens for o in outs] == list(range(1, 8))
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert all(o.num_prompt_tokens == len(p) for o in outs)
    assert engine.stats().recent_output_lens[-1] == 7
    # Text deltas add up to the decoded tokens.
    assert "".join(o.new_text for o in outs) == engine.decode(tokens(outs))


def test_greedy_is_deterministic_across_engines_and_batches(backend: str) -> None:
    p = (5, 6, 7, 8, 9, 10)
    one = build(backend)
    one.add_request(EngineRequest("a", p, greedy(9)))
    alone = tokens(run(one)["a"])
    many = build(backend)
    for i in range(4):
        many.add_request(EngineRequest(f"o{i}", (20 + i,) * (3 + 4 * i), greedy(5)))
    many.add_request(EngineRequest("a", p, greedy(9)))
    assert tokens(run(many)["a"]) == alone


def test_bad_input_raises_and_others_continue(backend: str) -> None:
    engine = build(backend)
    engine.add_request(EngineRequest("ok", (5, 6, 7), greedy(3)))
    for bad in (
        EngineRequest("b1", (), greedy(3)),
        EngineRequest("b2", (5,) * 200, greedy(3)),
        EngineRequest("b3", (5, 6), SamplingParams(max_tokens=0)),
    ):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad)
    outs = run(engine)
    assert set(outs) == {"ok"} and len(tokens(outs["ok"])) == 3


def test_abort_frees_everything(backend: str) -> None:
    engine = build(backend)
    total = engine.stats().num_total_blocks
    engine.add_request(EngineRequest("a", (5, 6, 7, 8, 9), greedy(30)))
    engine.step()
    assert engine.stats().num_free_blocks < total
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == total
    engine.abort("never-seen")  # harmless


def test_prefill_only_holds_blocks_until_released(backend: str) -> None:
    engine = build(backend)
    p = prompt_of(engine)
    engine.add_request(EngineRequest("p", p, greedy(10), prefill_only=True))
    (out,) = run(engine)["p"]
    assert out.finish_reason is FinishReason.PREFILLED and len(out.new_token_ids) == 1
    assert out.held_kv is not None and out.held_kv.num_tokens == len(p)
    assert len(out.held_kv.block_ids) == -(-len(p) // BLOCK_SIZE)
    assert engine.stats().num_held_blocks == len(out.held_kv.block_ids)
    engine.release_held("p")
    assert engine.stats().num_held_blocks == 0


def test_adopted_request_continues_as_if_colocated(backend: str) -> None:
    colocated = build(backend)
    p = prompt_of(colocated)
    colocated.add_request(EngineRequest("x", p, greedy(6)))
    expected = tokens(run(colocated)["x"])

    prefill, decode = build(backend), build(backend)
    prefill.add_request(EngineRequest("x", p, greedy(6), prefill_only=True))
    (first,) = run(prefill)["x"]
    assert first.held_kv is not None
    ids = decode.adopt(EngineRequest("x", p, greedy(6), output_token_ids=first.new_token_ids))
    src = torch.as_tensor(list(first.held_kv.block_ids))
    decode.kv_storage[torch.as_tensor(ids)] = prefill.kv_storage[src]
    prefill.release_held("x")
    decode.start_adopted("x")
    rest = run(decode)["x"]
    assert [*first.new_token_ids, *tokens(rest)] == expected
    assert rest[-1].num_output_tokens == 6


def test_encode_decode_round_trip(backend: str) -> None:
    engine = build(backend)
    assert engine.decode(engine.encode("hello world")) == "hello world"
