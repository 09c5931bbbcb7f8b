"""A request's grammar is compiled off the engine loop: a slow compile never stalls the
tokens of the other requests on the same worker (real tiny engine, in-process worker)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from router.types import Role
from services.cluster.factories import EngineFactory
from services.config import EngineConfig, ModelConfig
from services.engine.grammar import GrammarCompiler
from services.engine.loader import load_tokenizer
from services.engine.messages import EngineRequest, SamplingParams, StructuredOutput
from services.workers.messages import Generate, RequestFailed, TokenDelta
from services.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.asyncio
COMPILE_S = 0.35  # under the 0.5 s compile bound


async def test_a_slow_grammar_compile_does_not_stall_other_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = GrammarCompiler._compile_now

    def slow(self: GrammarCompiler, structured: StructuredOutput) -> Any:
        time.sleep(COMPILE_S)
        return original(self, structured)

    monkeypatch.setattr(GrammarCompiler, "_compile_now", slow)
    engine = EngineConfig(device="cpu", num_threads=1, kv_cache_bytes=8 * 2**20)
    worker = Worker(
        WorkerSpec("w", Role.MIXED, EngineFactory("embedded", ModelConfig(name="tiny"), engine))
    )
    prompt = tuple(load_tokenizer("tiny").encode("the quick brown fox"))
    plain = EngineRequest(
        "plain", prompt, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    )
    regex = StructuredOutput("regex", "[a-z]{3,6}")
    constrained = EngineRequest(
        "regex", prompt, SamplingParams(max_tokens=16, temperature=0.0, structured=regex)
    )
    arrivals: list[float] = []
    started = asyncio.Event()
    compile_window: list[float] = []

    async def stream_plain() -> None:
        async for event in worker.generate(Generate(plain)):
            assert isinstance(event, TokenDelta)
            arrivals.append(time.monotonic())
            started.set()

    async def stream_constrained() -> list[int]:
        await started.wait()
        compile_window.append(time.monotonic())
        tokens: list[int] = []
        async for event in worker.generate(Generate(constrained)):
            assert not isinstance(event, RequestFailed), event
            tokens.extend(event.token_ids)
        return tokens

    try:
        _, tokens = await asyncio.wait_for(asyncio.gather(stream_plain(), stream_constrained()), 60)
    finally:
        await worker.shutdown()
    assert tokens  # the constrained request ran after its compile
    begin = compile_window[0]
    during = [t for t in arrivals if begin <= t <= begin + COMPILE_S]
    assert len(during) >= 3, "the plain stream stopped while the grammar compiled"
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < COMPILE_S / 2
