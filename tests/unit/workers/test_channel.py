"""One event channel per (worker, gateway): a message per engine step, split per request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.types import Role
from services.backends.fake import FakeEngine, FakeTokenizer
from services.engine.messages import EngineRequest, FinishReason, SamplingParams
from services.workers.channel import ChannelClosed, Coalesced, EventDemux
from services.workers.messages import (
    EventBatch,
    FailureKind,
    Generate,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
)
from services.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.asyncio

TOK = FakeTokenizer()
NUM_REQUESTS, NUM_TOKENS = 8, 64


def job(request_id: str, max_tokens: int = NUM_TOKENS) -> Generate:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = tuple(TOK.encode(f"prompt of {request_id}"))
    return Generate(EngineRequest(request_id, prompt, sampling))


async def drain(queue: asyncio.Queue[WorkerEvent | ChannelClosed]) -> list[WorkerEvent]:
    events: list[WorkerEvent] = []
    while True:
        event = await queue.get()
        assert not isinstance(event, ChannelClosed), event.cause
        events.append(event)
        if isinstance(event, TokenDelta) and event.finish_reason is not None:
            return events


async def test_eight_decoding_requests_share_one_message_per_step() -> None:
    worker = Worker(WorkerSpec("w", Role.MIXED, FakeEngine, telemetry_interval_s=0.05))
    try:
        demux = EventDemux(worker.events("gw"), "gw")
        queues = [demux.register(f"r{i}") for i in range(NUM_REQUESTS)]
        for i in range(NUM_REQUESTS):
            await worker.submit("gw", job(f"r{i}"))
        streams = await asyncio.wait_for(asyncio.gather(*(drain(q) for q in queues)), 10)
        for events in streams:
            tokens = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
            assert len(tokens) == NUM_TOKENS
            assert events[-1].finish_reason is FinishReason.LENGTH  # type: ignore[union-attr]
        # A message per request per token would be 8 * 64; one per engine step is ~64.
        assert demux.num_events >= NUM_REQUESTS  # counted, not vacuous
        assert demux.num_batches <= NUM_TOKENS + NUM_REQUESTS, demux.num_batches
        demux.close()
    finally:
        await worker.shutdown()


async def test_closing_the_channel_aborts_its_requests_on_the_worker() -> None:
    worker = Worker(WorkerSpec("w", Role.MIXED, FakeEngine, telemetry_interval_s=0.05))
    try:
        batches = worker.events("gw")
        demux = EventDemux(batches, "gw")
        queue = demux.register("long")
        await worker.submit("gw", job("long", max_tokens=100_000))
        first = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(first, TokenDelta)
        demux.close()
        assert isinstance(await asyncio.wait_for(_last(queue), 5), ChannelClosed)
        for _ in range(200):
            if not (await worker.snapshot()).running:
                break
            await asyncio.sleep(0.01)
        assert not (await worker.snapshot()).running  # the gateway left: the request stopped
    finally:
        await worker.shutdown()


async def _last(
    queue: asyncio.Queue[WorkerEvent | ChannelClosed],
) -> WorkerEvent | ChannelClosed:
    while True:
        event = await queue.get()
        if isinstance(event, ChannelClosed):
            return event


async def test_a_broken_channel_closes_every_waiting_request() -> None:
    async def breaks() -> AsyncIterator[EventBatch]:
        yield EventBatch((TokenDelta("a", (1,), ""),))
        raise ConnectionError("peer gone")

    demux = EventDemux(breaks(), "gw")
    a, b = demux.register("a"), demux.register("b")
    assert isinstance(await asyncio.wait_for(a.get(), 1), TokenDelta)
    for queue in (a, b):
        closed = await asyncio.wait_for(queue.get(), 1)
        assert isinstance(closed, ChannelClosed) and "ConnectionError" in closed.cause
    late = demux.register("c")  # a request registered after the break fails at once
    assert isinstance(late.get_nowait(), ChannelClosed)


async def test_lagging_deltas_merge_and_an_event_after_them_keeps_its_place() -> None:
    """Deltas that piled up are read as one; a failure queued after them comes next, and
    whatever was queued after the failure still comes after it."""
    queued: asyncio.Queue[WorkerEvent | ChannelClosed] = asyncio.Queue()
    failed = RequestFailed("r", FailureKind.TRANSFER, "pull failed")
    for event in (
        TokenDelta("r", (1,), ""),
        TokenDelta("r", (2,), ""),
        failed,
        ChannelClosed("gone"),
    ):
        queued.put_nowait(event)
    reader = Coalesced(queued)
    first = await reader.get()
    assert isinstance(first, TokenDelta) and first.token_ids == (1, 2)
    assert await reader.get() is failed
    closed = await reader.get()
    assert isinstance(closed, ChannelClosed) and closed.cause == "gone"
