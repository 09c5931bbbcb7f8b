"""Worker handles as the gateway and the controller see them.

``WorkerClient`` is the seam: the same calls whether the worker is a Ray actor
(``RayWorkerClient``) or an object in this process (``InProcessWorkerClient``,
used by unit tests and the in-process benchmark). A worker that died surfaces
as ``WorkerDiedError`` from any of the async calls or streams, whatever the
transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol

from router.types import Role
from services.workers.channel import ChannelClosed, Coalesced, EventDemux, is_final
from services.workers.messages import EventBatch, Job, WorkerEvent, WorkerSnapshot
from services.workers.socket_channel import SocketChannel
from services.workers.worker import Worker

__all__ = [
    "InProcessWorkerClient",
    "RayWorkerClient",
    "Transport",
    "WorkerClient",
    "WorkerDiedError",
    "death_cause",
]

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    def __init__(self, worker_id: str, cause: str = "") -> None:
        super().__init__(f"worker {worker_id} died" + (f": {cause}" if cause else ""))
        self.worker_id = worker_id


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: ``SomeError: message`` (not indented).
_RAISED = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*): ")
_MAX_CAUSE_CHARS = 300


def death_cause(e: BaseException) -> str:
    """Why a worker's actor died, in one line: the error's name, and for an actor whose
    ``__init__`` raised (a model that does not load, an engine option refused), what it
    raised, so the controller's log and ``/ready`` say why a slot keeps crashing."""
    name = type(e).__name__
    if not getattr(e, "actor_init_failed", False):
        return name
    lines = [line for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        raised_by = _RAISED.match(lines[i])
        if raised_by:  # the exception's own name, without its module
            first = raised_by.group(1) + ": " + lines[i][raised_by.end() :]
            raised = " ".join(line.strip() for line in (first, *lines[i + 1 :]))
            return f"{name} in its __init__: {raised[:_MAX_CAUSE_CHARS]}"
    return name


class WorkerClient(Protocol):
    worker_id: str

    def generate(self, job: Job) -> AsyncIterator[WorkerEvent]: ...

    def abort(self, request_id: str) -> None:
        """Fire and forget; safe inside a cancelled coroutine's ``finally``."""
        ...

    def telemetry(self) -> AsyncIterator[WorkerSnapshot]: ...

    async def snapshot(self) -> WorkerSnapshot: ...

    async def ping(self) -> str: ...

    async def set_role(self, role: Role) -> Role: ...

    async def shutdown(self) -> None: ...

    def kill(self) -> None:
        """Stop the worker without asking it (it may be hung or gone)."""
        ...


class InProcessWorkerClient:
    def __init__(self, worker: Worker) -> None:
        self.worker_id = worker.worker_id
        self.worker = worker

    def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        return self.worker.generate(job)

    def abort(self, request_id: str) -> None:
        self.worker.abort_soon(request_id)

    def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        return self.worker.telemetry()

    async def snapshot(self) -> WorkerSnapshot:
        return await self.worker.snapshot()

    async def ping(self) -> str:
        return await self.worker.ping()

    async def set_role(self, role: Role) -> Role:
        return await self.worker.set_role(role)

    async def shutdown(self) -> None:
        await self.worker.shutdown()

    def kill(self) -> None:
        self.worker.stop_now()


# A Ray channel (and a telemetry stream) waits once this many items are unread. This is
# how a worker learns that a gateway process died: the wait fails, the worker's ``events``
# generator is closed, and its ``finally`` aborts that gateway's requests and frees their
# blocks (without a bound, Ray would keep the generator running for a consumer that is
# gone). Nothing is lost while it waits: the outbox gathers queued events into one batch.
_UNREAD_BATCHES = 8
_CONNECT_TIMEOUT_S = 5.0  # the socket channel's connect, and the worker's answer to it

Transport = Literal["socket", "ray"]


class _Channel(Protocol):
    demux: EventDemux

    @property
    def closed(self) -> bool: ...

    def submit(self, job: Job) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def close(self) -> None: ...


class RayWorkerClient:
    """Calls a ``Worker`` Ray actor.

    Token events of every request this client runs on the actor arrive through one
    channel: one message per engine step, split into per-request streams here
    (``EventDemux``). The channel is a direct TCP connection to the worker
    (``services/workers/socket_channel.py``), found through a Ray call; with
    ``transport="ray"``, or when the socket cannot be reached, it is a Ray streaming
    call of ``Worker.events`` instead. It is opened on first use in each event loop; a
    channel that breaks fails its requests with ``WorkerDiedError``, and the next request
    opens a new one. Control calls (snapshot, set_role, telemetry...) always go through Ray.
    """

    def __init__(self, worker_id: str, actor: Any, transport: Transport = "socket") -> None:
        self.worker_id = worker_id
        self.actor = actor
        self.transport: Transport = transport  # of the channel now open ("ray" after a fallback)
        self._wanted: Transport = transport
        self._channel: _Channel | None = None
        self._channel_loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Task[_Channel] | None = None

    @property
    def num_messages(self) -> int:
        """Transport messages received on the current channel (for tests and benchmarks)."""
        return self._channel.demux.num_batches if self._channel is not None else 0

    async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        channel = await self._open_channel()
        request_id = job.request.request_id
        events = channel.demux.register(request_id)
        channel.submit(job)
        reader = Coalesced(events)
        finished = False
        try:
            while not finished:
                event = await reader.get()
                if isinstance(event, ChannelClosed):
                    raise WorkerDiedError(self.worker_id, event.cause)
                finished = is_final(event)
                yield event
        finally:
            channel.demux.unregister(request_id)
            if not finished:
                channel.abort(request_id)

    async def _open_channel(self) -> _Channel:
        """This event loop's channel: the open one, or one opened now (once, however many
        requests ask at the same time)."""
        loop = asyncio.get_running_loop()
        channel = self._channel
        if channel is not None and not channel.closed and self._channel_loop is loop:
            return channel
        opening = self._opening
        if opening is None or opening.get_loop() is not loop:
            opening = self._opening = loop.create_task(self._connect())
        return await asyncio.shield(opening)

    async def _connect(self) -> _Channel:
        import ray

        subscriber = f"gw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        channel: _Channel | None = None
        try:
            if self._wanted == "socket":
                try:
                    address = await self.actor.channel_address.remote()
                    channel = await SocketChannel.connect(address, subscriber, _CONNECT_TIMEOUT_S)
                except ray.exceptions.RayActorError as e:
                    raise WorkerDiedError(self.worker_id, death_cause(e)) from e
                except (OSError, TimeoutError) as e:
                    log.warning(
                        "worker %s: no socket channel (%r); events go through Ray",
                        self.worker_id,
                        e,
                    )
            if channel is None:
                channel = _RayChannel(self.actor, subscriber)
            self.transport = "socket" if isinstance(channel, SocketChannel) else "ray"
            self._channel, self._channel_loop = channel, asyncio.get_running_loop()
            return channel
        finally:
            self._opening = None

    def abort(self, request_id: str) -> None:
        channel = self._channel
        if channel is not None and not channel.closed:
            channel.abort(request_id)
        else:  # e.g. a held prefill's blocks, after its channel broke
            self.actor.abort.remote(request_id)

    async def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        import ray

        stream = self.actor.telemetry.options(
            num_returns="streaming", _generator_backpressure_num_objects=_UNREAD_BATCHES
        ).remote()
        try:
            async for ref in stream:
                yield await _value(ref)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.worker_id, death_cause(e)) from e
        finally:
            with contextlib.suppress(Exception):
                ray.cancel(stream)

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.worker_id, death_cause(e)) from e

    async def snapshot(self) -> WorkerSnapshot:
        result: WorkerSnapshot = await self._call("snapshot")
        return result

    async def ping(self) -> str:
        result: str = await self._call("ping")
        return result

    async def set_role(self, role: Role) -> Role:
        result: Role = await self._call("set_role", role)
        return result

    async def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        await self._call("shutdown")

    def kill(self) -> None:
        import ray

        if self._channel is not None:
            self._channel.close()
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


class _RayChannel:
    """The channel through Ray: a streaming call of ``Worker.events`` in, actor calls out."""

    def __init__(self, actor: Any, subscriber: str) -> None:
        self._actor = actor
        self._subscriber = subscriber
        self.demux = EventDemux(self._batches(), subscriber)

    @property
    def closed(self) -> bool:
        return self.demux.closed

    def submit(self, job: Job) -> None:
        self._actor.submit.remote(self._subscriber, job)

    def abort(self, request_id: str) -> None:
        self._actor.abort.remote(request_id)

    def close(self) -> None:
        self.demux.close()

    async def _batches(self) -> AsyncIterator[EventBatch]:
        import ray

        stream = self._actor.events.options(
            num_returns="streaming", _generator_backpressure_num_objects=_UNREAD_BATCHES
        ).remote(self._subscriber)
        try:
            async for ref in stream:
                yield await _value(ref)
        finally:
            with contextlib.suppress(Exception):
                ray.cancel(stream)


async def _value(ref: Any) -> Any:
    """A stream item's value: read at once when it is already here, else awaited.

    A small item (every event batch but huge ones) arrives inline with the stream's
    report, so it is here when the stream yields its ref; awaiting a ready ref still
    goes through Ray's future machinery, 0.2-0.5 ms an item measured here (an
    actor's stream on a loaded 2-core box, p50 of 300 items). An item held elsewhere
    (a large one, another node's) is awaited, never waited for on the event loop.
    """
    import ray

    try:
        return ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return await ref
