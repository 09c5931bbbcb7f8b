"""One event stream per (worker, gateway): every engine step's events in one message.

A message costs a transport hop on each side (about a millisecond of CPU for a Ray
streaming item, tens of microseconds for a socket frame), so a stream per request
would pay that once per token per request. Instead each gateway opens one channel
per worker and the worker sends it one ``EventBatch`` per engine step, carrying the
new tokens of every request of that gateway (as vLLM's engine core sends its
outputs). The two ends, whatever carries the batches between them::

    worker side   Outbox           events of one subscriber, gathered between sends
    gateway side  EventDemux       one channel's batches, split into per-request queues

The carriers: a direct TCP socket (``services/workers/socket_channel.py``, the
default) or a Ray streaming call of ``Worker.events`` (the fallback).

Call order (gateway)::

    demux = EventDemux(batches, subscriber)  batches: the carrier's messages
    queue = demux.register(request_id)     before the job is submitted
    ... submit the job (a socket frame, or worker.submit(subscriber, job)) ...
    event = await queue.get()              a WorkerEvent, or a ChannelClosed
    demux.unregister(request_id)

A channel that ends (the worker died, the stream broke) closes every registered
queue with ``ChannelClosed``; the caller turns it into ``WorkerDiedError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from services.workers.messages import (
    EventBatch,
    ImagesEncoded,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
)

__all__ = ["ChannelClosed", "Coalesced", "EventDemux", "Outbox", "is_final"]


def is_final(event: WorkerEvent) -> bool:
    """The last event of a request's stream."""
    return isinstance(event, RequestFailed | ImagesEncoded) or (
        isinstance(event, TokenDelta) and event.finish_reason is not None
    )


@dataclass(frozen=True, slots=True)
class ChannelClosed:
    """Put into a request's queue when its channel ends before the request did."""

    cause: str


class Outbox:
    """The worker's side of one channel: events waiting for the next send."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()  # submitted, not yet final
        self._pending: list[WorkerEvent] = []
        self._wake = asyncio.Event()
        # A carrier that can send without waiting (a socket with room in its buffers)
        # sends at the wake, in the same event-loop turn, instead of waking a sender task
        # for it; False means "not now", and the sender task takes the batch.
        self.send_now: Callable[[EventBatch], bool] | None = None

    def put(self, event: WorkerEvent) -> None:
        """Queue ``event``; the caller calls ``wake`` once after a step's events."""
        self._pending.append(event)
        if is_final(event):
            self.request_ids.discard(event.request_id)

    def wake(self) -> None:
        send_now = self.send_now
        if send_now is not None and self._pending and send_now(EventBatch(tuple(self._pending))):
            self._pending = []
            return
        self._wake.set()

    async def next_batch(self) -> EventBatch:
        """Everything queued since the last batch (several steps' if the reader lagged)."""
        while not self._pending:
            await self._wake.wait()
            self._wake.clear()
        events, self._pending = tuple(self._pending), []
        return EventBatch(events)


class EventDemux:
    """The gateway's side of one channel: split batches into per-request queues."""

    def __init__(self, batches: AsyncIterator[EventBatch], subscriber: str = "") -> None:
        self.subscriber = subscriber  # the name the worker knows this channel by
        self.num_batches = 0  # transport messages received
        self.num_events = 0
        self._queues: dict[str, asyncio.Queue[WorkerEvent | ChannelClosed]] = {}
        self._closed: ChannelClosed | None = None
        self._task = asyncio.get_running_loop().create_task(self._pump(batches))

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def register(self, request_id: str) -> asyncio.Queue[WorkerEvent | ChannelClosed]:
        queue: asyncio.Queue[WorkerEvent | ChannelClosed] = asyncio.Queue()
        if self._closed is not None:
            queue.put_nowait(self._closed)
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def close(self) -> None:
        self._task.cancel()

    async def _pump(self, batches: AsyncIterator[EventBatch]) -> None:
        cause = "the event channel ended"
        try:
            async for batch in batches:
                self.num_batches += 1
                self.num_events += len(batch.events)
                for event in batch.events:
                    queue = self._queues.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
        except asyncio.CancelledError:
            cause = "the event channel was closed"
            raise
        except Exception as e:  # the worker died, or the transport broke: same for us
            cause = type(e).__name__
        finally:
            self._closed = ChannelClosed(cause)
            for queue in self._queues.values():
                queue.put_nowait(self._closed)
            aclose = getattr(batches, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class Coalesced:
    """One request's queue, read with the token deltas that piled up behind an event
    merged into it (only when the consumer lags), in arrival order.

    A delta is "everything since the last one" either way; merging saves the consumer
    one wake-up per step it fell behind. An event that is not a delta ends a merge and
    is the next one ``get`` returns, so nothing queued after it overtakes it.
    """

    def __init__(self, queued: asyncio.Queue[WorkerEvent | ChannelClosed]) -> None:
        self._queued = queued
        self._carried: WorkerEvent | ChannelClosed | None = None

    async def get(self) -> WorkerEvent | ChannelClosed:
        event, self._carried = self._carried, None
        if event is None:
            event = await self._queued.get()
        queued = self._queued
        while isinstance(event, TokenDelta) and event.finish_reason is None and not queued.empty():
            follower = queued.get_nowait()
            if not isinstance(follower, TokenDelta):
                self._carried = follower
                break
            event = dataclasses.replace(
                follower,
                token_ids=event.token_ids + follower.token_ids,
                logprobs=(event.logprobs or ()) + (follower.logprobs or ())
                if event.logprobs or follower.logprobs
                else None,
                prompt_logprobs=event.prompt_logprobs or follower.prompt_logprobs,
            )
        return event
