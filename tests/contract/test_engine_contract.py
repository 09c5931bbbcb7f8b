"""The Engine protocol's contract, run against every implementation by backend name.

Adding an implementation to the contract is one line in ``BACKENDS_UNDER_TEST``
(it must also be registered in ``services.backends.BACKENDS``).

``vllm`` runs for real (its CPU build): two engines, each in a Ray actor of its own
(vLLM's in-process engine owns process-wide state), shared by the module; P/D between
them goes over vLLM's NixlConnector. Engines that move their own KV (``moves_own_kv``)
hand a prefill's ``remote_kv`` to the decoder instead of adopt + a Baton pull.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.backends import make_engine
from services.backends.protocol import Engine
from services.config import EngineConfig, ModelConfig
from services.engine.messages import (
    EngineRequest,
    FinishReason,
    ImageInput,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
)
from tests.unit.engine.llava_twin import png_bytes, random_image

BACKENDS_UNDER_TEST = [
    "embedded",
    "fake",
    pytest.param("vllm", marks=[pytest.mark.ray, pytest.mark.vllm]),
]

BLOCK_SIZE = 4
LEASE_S = 2.0
CONFIG = EngineConfig(
    device="cpu", block_size=BLOCK_SIZE, kv_cache_bytes=2**20, max_model_len=64, num_threads=1
)

Build = Callable[[], Engine]


@pytest.fixture(scope="module")
def vllm_engines(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    from tests.support.vllm import RemoteEngine, build_vllm_checkpoint

    folder: Path = build_vllm_checkpoint(tmp_path_factory.mktemp("contract-vllm"))
    model = ModelConfig(name=str(folder), dtype="float32", seed=0)
    cfg = CONFIG.model_copy(update={"kv_cache_bytes": 4 * 2**20, "vllm": {"enforce_eager": True}})
    engines = [RemoteEngine("vllm", model, cfg, kv_lease_s=LEASE_S) for _ in range(2)]
    yield engines
    for e in engines:
        e.close()


@pytest.fixture(params=BACKENDS_UNDER_TEST)
def build(request: pytest.FixtureRequest) -> Build:
    """build() -> an engine; vllm hands out its two shared engines in turn."""
    backend = str(request.param)
    if backend == "vllm":
        shared = itertools.cycle(request.getfixturevalue("vllm_engines"))
        return lambda: next(shared)
    return lambda: make_engine(backend, ModelConfig(name="tiny", seed=0), CONFIG)


def moves_own_kv(engine: Engine) -> bool:
    return bool(getattr(engine, "moves_own_kv", False))


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


def release_and_wait(engine: Engine, request_id: str) -> None:
    """Release a prefill-only request's hold and step until it is gone: vLLM frees its
    hold at the lease's end, and the next test on the shared engine counts holds."""
    engine.release_held(request_id)
    held_s = time.monotonic()
    while engine.stats().num_held_blocks:
        assert time.monotonic() - held_s < LEASE_S + 3, "the lease never freed the hold"
        engine.step()
        time.sleep(0.05)


def prompt_of(engine: Engine, text: str = "The quick brown fox") -> tuple[int, ...]:
    return tuple(engine.encode(text))


def test_is_an_engine(build: Build) -> None:
    engine = build()
    assert isinstance(engine, Engine)
    info = engine.model_info
    assert info.max_model_len <= 64 and info.vocab_size > 0
    # vLLM picks its platform's block size (CPU attention: a multiple of 32)
    expected = 128 if moves_own_kv(engine) else BLOCK_SIZE
    assert engine.kv_layout.block_size == engine.stats().block_size == expected


def test_runs_to_max_tokens_with_deltas(build: Build) -> None:
    engine = build()
    p = prompt_of(engine)
    engine.add_request(EngineRequest("a", p, greedy(7)))
    outs = run(engine)["a"]
    assert len(tokens(outs)) == 7
    assert [o.num_output_tokens for o in outs] == list(range(1, 8))
    assert all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert all(o.num_prompt_tokens == len(p) for o in outs)
    assert engine.stats().recent_output_lens[-1] == 7
    assert not any(hasattr(o, "new_text") for o in outs)  # the gateway owns text


def test_greedy_is_deterministic_across_engines_and_batches(build: Build) -> None:
    p = (5, 6, 7, 8, 9, 10)
    one = build()
    one.add_request(EngineRequest("a", p, greedy(9)))
    alone = tokens(run(one)["a"])
    many = build()
    for i in range(4):
        many.add_request(EngineRequest(f"o{i}", (20 + i,) * (3 + 4 * i), greedy(5)))
    many.add_request(EngineRequest("a", p, greedy(9)))
    assert tokens(run(many)["a"]) == alone


def test_bad_input_raises_and_others_continue(build: Build) -> None:
    engine = build()
    engine.add_request(EngineRequest("ok", (5, 6, 7), greedy(3)))
    for bad in (
        EngineRequest("b1", (), greedy(3)),
        EngineRequest("b2", (5,) * 200, greedy(3)),
        EngineRequest("b3", (5, 6), SamplingParams(max_tokens=0)),
        # Past the vocabulary (2^63 overflowed the sampler's int64 and killed the loop).
        EngineRequest("b4", (5, 6), SamplingParams(max_tokens=3, top_k=2**63)),
        # Past 64 bits: vLLM's sampler failed the whole step, every request in it.
        EngineRequest("b6", (5, 6), SamplingParams(max_tokens=3, seed=2**64)),
        # A token id past the vocabulary: an embedding lookup out of range.
        EngineRequest("b5", (5, 10**6), greedy(3)),
    ):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad)
    outs = run(engine)
    assert set(outs) == {"ok"} and len(tokens(outs["ok"])) == 3


def test_prompt_logprobs_go_once_with_the_first_output(build: Build) -> None:
    """Prompt tokens 1..P-1, each with its top 2 alternatives, on the first output of
    a request that computes its prompt here, whole or prefill-only (the same values);
    none from a continuation, whose first token came from elsewhere."""
    engine = build()
    p = prompt_of(engine, "the cat sat on the mat and the dog")
    sampling = replace(greedy(3), prompt_logprobs=2)
    engine.add_request(EngineRequest("whole", p, sampling))
    engine.add_request(EngineRequest("cont", p, sampling, output_token_ids=(p[1],)))
    outs = run(engine)
    first = outs["whole"][0].prompt_logprobs
    assert first is not None and [lp.token_id for lp in first] == list(p[1:])
    for lp in first:  # the most likely first; the prompt token's own value where listed
        values = [v for _, v in lp.top]
        assert len(values) >= 2 and values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] + 1e-6 <= 1e-6
        assert dict(lp.top).get(lp.token_id, lp.logprob) == pytest.approx(lp.logprob, abs=1e-6)
    assert all(o.prompt_logprobs is None for o in outs["whole"][1:] + outs["cont"])
    assert len(tokens(outs["cont"])) == 2

    engine.add_request(EngineRequest("pf", p, sampling, prefill_only=True))
    (prefilled,) = run(engine)["pf"]
    assert prefilled.prompt_logprobs is not None
    assert [lp.token_id for lp in prefilled.prompt_logprobs] == list(p[1:])
    got = [lp.logprob for lp in prefilled.prompt_logprobs]
    assert got == pytest.approx([lp.logprob for lp in first], abs=1e-4)
    release_and_wait(engine, "pf")


@pytest.mark.ray
@pytest.mark.vllm
def test_vllm_text_model_refuses_images_and_keeps_serving(vllm_engines: list) -> None:
    """Images to a text-only model under vLLM (which takes images for LLaVA checkpoints:
    tests/e2e/test_vllm_images.py): refused, never served with the images dropped, and
    the engine serves on; so is a file that does not decode."""
    engine = vllm_engines[0]
    png = png_bytes(random_image(1, 8, 8))
    for data in (png, b"\x89PNG\r\n\x1a\n"):
        image = ImageInput("ab" * 32, offset=1, num_tokens=2, data=data)
        with pytest.raises(InvalidRequestError):
            engine.add_request(EngineRequest("img", (5, 9, 9, 6), greedy(3), images=(image,)))
    engine.add_request(EngineRequest("ok", (5, 6, 7), greedy(3)))
    outs = run(engine)
    assert set(outs) == {"ok"} and len(tokens(outs["ok"])) == 3


def test_abort_frees_everything(build: Build) -> None:
    engine = build()
    total = engine.stats().num_total_blocks
    engine.add_request(EngineRequest("a", (5, 6, 7, 8, 9), greedy(30)))
    engine.step()
    assert engine.stats().num_free_blocks < total
    engine.abort("a")
    assert not engine.has_unfinished()
    assert engine.stats().num_free_blocks == total
    engine.abort("never-seen")  # harmless


def test_a_continued_request_reports_the_outputs_it_carries(build: Build) -> None:
    """A request re-placed after its worker died carries the tokens already streamed: its
    running row counts them in what it generated and in its cap, as the router's memory
    estimate reads them (vLLM counts its outputs from a prompt that holds them)."""
    engine = build()
    p = prompt_of(engine, "hello world the cat")
    engine.add_request(EngineRequest("c0", p, greedy(3)))
    carried = tuple(tokens(run(engine)["c0"]))
    engine.add_request(EngineRequest("c1", p, greedy(8), output_token_ids=carried))
    engine.step()  # its prompt and the carried tokens, and one new token
    (row,) = engine.stats().running
    assert (row.num_generated, row.max_tokens) == (len(carried) + 1, 8)
    engine.abort("c1")


def test_waiting_prompts_are_reported_with_their_request_ids(build: Build) -> None:
    engine = build()
    p = prompt_of(engine, "hello world the cat")
    engine.add_request(EngineRequest("w1", p, greedy(4)))
    engine.add_request(EngineRequest("w2", p[:3], greedy(4)))
    stats = engine.stats()
    assert stats.waiting_request_ids == ("w1", "w2")  # vLLM's own ids carry a suffix
    assert stats.waiting_prompt_lens == (len(p), 3)
    run(engine)
    assert engine.stats().waiting_request_ids == ()


def test_a_prefill_only_request_s_step_is_recorded_with_its_prompt(build: Build) -> None:
    """The step that prefills a request for a decoder elsewhere (it finishes in that
    step) is in the engine's recent steps with its prompt's tokens: a prefill worker's
    cost model learns from nothing else."""
    engine = build()
    p = prompt_of(engine, "the cat sat on the mat and the dog")
    started = max((s.end_s for s in engine.stats().recent_steps), default=0.0)
    engine.add_request(EngineRequest("pf", p, greedy(4), prefill_only=True))
    run(engine)
    steps = [s for s in engine.stats().recent_steps if s.end_s > started]
    assert sum(s.num_prefill_tokens for s in steps) == len(p), steps
    release_and_wait(engine, "pf")


def test_prefill_only_holds_blocks_until_released(build: Build) -> None:
    engine = build()
    p = prompt_of(engine)
    engine.add_request(EngineRequest("p", p, greedy(10), prefill_only=True))
    (out,) = run(engine)["p"]
    assert out.finish_reason is FinishReason.PREFILLED and len(out.new_token_ids) == 1
    block_size = engine.kv_layout.block_size
    if moves_own_kv(engine):
        # The engine's own transfer parameters, no Baton block list; held until a
        # decoder pulls or the lease runs out (released by the engine itself).
        assert out.held_kv is None and out.remote_kv is not None
        assert engine.stats().num_held_blocks == math.ceil(len(p) / block_size)
        held_s = time.monotonic()
        while engine.stats().num_held_blocks:
            assert time.monotonic() - held_s < LEASE_S + 3, "the lease never freed the hold"
            engine.step()  # what the worker loop does while the engine holds blocks
            time.sleep(0.05)
        assert time.monotonic() - held_s >= LEASE_S - 0.5
        return
    assert out.held_kv is not None and out.held_kv.num_tokens == len(p)
    assert len(out.held_kv.block_ids) == -(-len(p) // block_size)
    assert engine.stats().num_held_blocks == len(out.held_kv.block_ids)
    engine.release_held("p")
    assert engine.stats().num_held_blocks == 0


def test_adopted_request_continues_as_if_colocated(build: Build) -> None:
    colocated = build()
    p = prompt_of(colocated, "hello world the cat sat on the mat")
    colocated.add_request(EngineRequest("x", p, greedy(6)))
    expected = tokens(run(colocated)["x"])

    prefill, decode = build(), build()
    assert prefill is not decode
    # Prompt logprobs asked for: the prefill worker scores the prompt; the decoder, whose
    # prompt KV is pulled (no logits to score it by), sends none.
    scored = replace(greedy(6), prompt_logprobs=1)
    prefill.add_request(EngineRequest("x2", p, scored, prefill_only=True))
    (first,) = run(prefill)["x2"]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(p) - 1
    continued = EngineRequest("x2", p, scored, output_token_ids=first.new_token_ids)
    if moves_own_kv(decode):
        assert first.remote_kv is not None
        decode.add_request(replace(continued, remote_kv=first.remote_kv))
    else:
        assert first.held_kv is not None
        ids = decode.adopt(continued)
        src = torch.as_tensor(list(first.held_kv.block_ids))
        decode.kv_storage[torch.as_tensor(ids)] = prefill.kv_storage[src]
        prefill.release_held("x2")
        decode.start_adopted("x2")
    rest = run(decode)["x2"]
    assert all(o.prompt_logprobs is None for o in rest)
    assert [*first.new_token_ids, *tokens(rest)] == expected
    assert rest[-1].num_output_tokens == 6


def test_encode_decode_round_trip(build: Build) -> None:
    engine = build()
    assert engine.decode(engine.encode("hello world")) == "hello world"
