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


class BrokenPullConnector:
    """A local connector whose transport raises its own error, not KVTransferError, on
    ``pull`` (mode "pull") or on ``poll`` (mode "poll"), as NIXL and torch do (tests only)."""

    def __init__(self, agent: str, mode: str) -> None:
        from kvtransfer import make_connector

        self._inner = make_connector("local", agent_name=agent, lease_s=1.0)
        self._mode = mode
        self.broken = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def pull(self, *args: Any) -> Any:
        if self.broken and self._mode == "pull":
            raise RuntimeError("UCX: connection reset by peer")
        return self._inner.pull(*args)

    def poll(self, transfer_id: str) -> Any:
        if self.broken and self._mode == "poll":
            raise RuntimeError("gloo: connection closed")
        return self._inner.poll(transfer_id)


@pytest.mark.parametrize("mode", ["pull", "poll"])
async def test_a_transport_error_fails_the_transfer_only_and_the_decoder_serves_on(
    mode: str,
) -> None:
    from kvtransfer import make_connector
    from services.workers.messages import Continue

    connectors: list[BrokenPullConnector] = []

    def broken(agent: str) -> BrokenPullConnector:
        connectors.append(BrokenPullConnector(agent, mode))
        return connectors[-1]

    def local(agent: str) -> Any:
        return make_connector("local", agent_name=agent, lease_s=1.0)

    prefill = Worker(
        WorkerSpec(f"p-{mode}", Role.PREFILL, FakeEngine, local, telemetry_interval_s=0.05)
    )
    decode = Worker(
        WorkerSpec(f"d-{mode}", Role.DECODE, FakeEngine, broken, telemetry_interval_s=0.05)
    )
    try:
        bystander = asyncio.ensure_future(_drain(decode, _request("bystander", 40)))
        first = (await _drain(prefill, dataclasses.replace(_request("x", 8), prefill_only=True)))[0]
        cont = dataclasses.replace(_request("x", 8), output_token_ids=first.token_ids)
        events = await asyncio.wait_for(_collect(decode.generate(Continue(cont, first.handle))), 5)
        assert isinstance(events[-1], RequestFailed) and events[-1].kind is FailureKind.TRANSFER
        done = await asyncio.wait_for(bystander, 10)  # the engine's other request is untouched
        assert isinstance(done[-1], TokenDelta) and done[-1].finish_reason is not None
        connectors[0].broken = False
        second = (await _drain(prefill, dataclasses.replace(_request("y", 8), prefill_only=True)))[
            0
        ]
        cont = dataclasses.replace(_request("y", 8), output_token_ids=second.token_ids)
        events = await asyncio.wait_for(_collect(decode.generate(Continue(cont, second.handle))), 5)
        assert isinstance(events[-1], TokenDelta) and events[-1].finish_reason is not None
    finally:
        await prefill.shutdown()
        await decode.shutdown()


async def _collect(stream: Any) -> list[Any]:
    return [e async for e in stream]
