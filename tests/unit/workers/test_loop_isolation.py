"""One request's failure never ends an engine loop: a step that raises fails the requests
in the engine (the gateway re-places them), and the worker goes on serving."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from router.types import Role
from services.backends.fake import FakeEngine, FakeTokenizer
from services.engine.messages import EngineRequest, SamplingParams
from services.workers.messages import FailureKind, Generate, RequestFailed, TokenDelta
from services.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.asyncio
TOK = FakeTokenizer()


class ExplodingFakeEngine(FakeEngine):
    """A fake whose step raises while a request named ``poison`` is in it (tests only)."""

    def step(self) -> Any:
        if any(s.request.request_id == "poison" for s in (*self._waiting, *self._running)):
            raise RuntimeError("sampler blew up")
        return super().step()


def _request(rid: str, max_tokens: int) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, tuple(TOK.encode("hello there")), sampling)


async def _drain(worker: Worker, request: EngineRequest) -> list[Any]:
    return [e async for e in worker.generate(Generate(request))]


async def test_a_step_that_raises_fails_its_requests_and_the_worker_keeps_serving() -> None:
    worker = Worker(WorkerSpec("w", Role.MIXED, ExplodingFakeEngine, telemetry_interval_s=0.05))
    try:
        events = await asyncio.wait_for(_drain(worker, _request("poison", 50)), 5)
        assert isinstance(events[-1], RequestFailed)
        assert events[-1].kind is FailureKind.INTERNAL and "sampler blew up" in events[-1].message
        after = await asyncio.wait_for(_drain(worker, _request("after", 6)), 5)
        assert isinstance(after[-1], TokenDelta) and after[-1].finish_reason is not None
        assert sum(len(e.token_ids) for e in after) == 6
        snapshot = await worker.snapshot()
        assert snapshot.num_used_blocks == 0  # the failed request's blocks were freed
    finally:
        await worker.shutdown()


class HangingFakeEngine(FakeEngine):
    """A fake whose step hangs for a while once a request named ``hang`` is in it."""

    def step(self) -> Any:
        if any(s.request.request_id == "hang" for s in (*self._waiting, *self._running)):
            time.sleep(1.5)
        return super().step()


async def test_a_hung_engine_loop_fails_the_liveness_ping() -> None:
    from services.workers.worker import EngineStalledError

    spec = WorkerSpec("w", Role.MIXED, HangingFakeEngine, telemetry_interval_s=0.05)
    worker = Worker(dataclasses.replace(spec, stall_timeout_s=0.3))
    try:
        assert await worker.ping() == "w"  # idle: the loop beats between waits
        stream = worker.generate(Generate(_request("hang", 4)))
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.6)
        with pytest.raises(EngineStalledError, match="silent"):
            await worker.ping()
        await pending
        await stream.aclose()
    finally:
        await worker.shutdown()
