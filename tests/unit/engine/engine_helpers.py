"""Helpers shared by the engine tests: build engines, run requests to completion."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from services.backends.embedded import make_embedded_engine
from services.config import EngineConfig, ModelConfig
from services.engine.engine import LLMEngine
from services.engine.messages import EngineRequest, RequestOutput, SamplingParams


def make_engine(name: str | Path = "tiny", **engine_kw: object) -> LLMEngine:
    engine_kw.setdefault("device", "cpu")
    engine_kw.setdefault("block_size", 4)
    engine_kw.setdefault("num_threads", 1)  # more threads than free cores thrash in CI
    cfg = EngineConfig.model_validate(engine_kw)
    return make_embedded_engine(ModelConfig(name=str(name), dtype="float32"), cfg)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; every request's deltas, in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def tokens_of(outputs: Iterable[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def serve(engine: LLMEngine, requests: Iterable[EngineRequest]) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    return {rid: tokens_of(outs) for rid, outs in run_all(engine).items()}
