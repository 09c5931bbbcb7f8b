"""The worker: one class whose role (prefill, decode, mixed) is a mode, not a type.

``Worker`` is a plain class with async methods. ``services.workers.actor`` turns
it into a Ray actor; tests and the in-process benchmark use it directly. Its
engine runs continuously in an ``EngineLoop`` thread; this class is the asyncio
side: one queue per request stream and one event per telemetry subscriber.

Call order seen from the gateway::

    async for event in worker.generate(Generate(req) | Continue(req, handle)): ...
    worker.abort(request_id)                       any time; idempotent

or, across a process boundary, one channel per gateway (services/workers/channel.py),
on a direct socket (services/workers/socket_channel.py: the default)::

    address = await worker.channel_address()       connect, prove address.secret, then
                                                   Submit / Abort out, EventBatch in

or through Ray (the fallback)::

    async for batch in worker.events(subscriber): ...   EventBatch per engine step
    await worker.submit(subscriber, job)                its events go to that channel

and for control, always through Ray::

    async for snapshot in worker.telemetry(): ...  one subscription per gateway
    await worker.set_role(Role.DECODE)             drains in-flight requests first
                                                   (not to mixed, which takes them all)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvtransfer.connector import KVConnector
from router.types import Role
from services.backends.protocol import Engine
from services.engine.messages import EngineRequest, InvalidRequestError
from services.workers.channel import ChannelClosed, Coalesced, Outbox, is_final
from services.workers.loop import EngineLoop
from services.workers.messages import (
    EventBatch,
    FailureKind,
    Job,
    RequestFailed,
    WorkerEvent,
    WorkerSnapshot,
)
from services.workers.socket_channel import ChannelAddress, ChannelServer, node_ip_address

__all__ = ["EngineStalledError", "Worker", "WorkerSpec"]


class EngineStalledError(RuntimeError):
    """The worker's engine loop stopped beating (a hung step, or its thread ended)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs to build itself (picklable: it travels to the actor)."""

    worker_id: str
    role: Role
    engine_factory: Callable[[], Engine]
    connector_factory: Callable[[str], KVConnector] | None = None
    telemetry_interval_s: float = 0.1
    max_num_seqs: int = 256
    num_gpus: float | None = None  # GPUs the worker's actor asks Ray for (None: the launcher's)
    # An engine loop whose heartbeat is older than this (stuck in a step, or dead) fails
    # the controller's pings, and the controller replaces the worker.
    stall_timeout_s: float = 60.0
    # The worker keeps its role: ``set_role`` changes nothing (an encode worker running
    # another engine than the text workers', as beside vLLM).
    fixed_role: bool = False
    nice: int = 0  # added to the nice value of the engine's threads (workers.nice)
    # The same for prefill and encode engines (workers.prefill_nice; None: ``nice``).
    prefill_nice: int | None = None


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.worker_id = spec.worker_id
        self._role = spec.role
        self._fixed_role = spec.fixed_role
        self._draining = False
        self._stall_timeout_s = spec.stall_timeout_s
        engine = spec.engine_factory()
        # Optional engine capability: thread-safe per-request work done before the
        # request reaches the engine loop (compiling its grammar), so that a slow
        # compile never stalls the other requests' steps.
        self._prepare: Callable[[EngineRequest], None] | None = getattr(engine, "prepare", None)
        connector = spec.connector_factory(spec.worker_id) if spec.connector_factory else None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[WorkerEvent | ChannelClosed]] = {}
        self._outboxes: dict[str, Outbox] = {}  # subscriber -> its channel's outbox
        self._owners: dict[str, Outbox] = {}  # request_id -> the outbox of its channel
        self._subscribers: set[asyncio.Event] = set()
        self._server: ChannelServer | None = None  # the socket channel, opened on first ask
        self._preparing: set[asyncio.Task[None]] = set()
        self._latest: WorkerSnapshot | None = None
        self._loop = EngineLoop(
            spec.worker_id,
            engine,
            connector,
            on_events=self._post_events,
            on_snapshot=self._post_snapshot,
            role_state=lambda: (self._role, self._draining),
            telemetry_interval_s=spec.telemetry_interval_s,
            max_num_seqs=spec.max_num_seqs,
            nice=spec.nice,
            prefill_nice=spec.prefill_nice,
        )
        self._loop.start()

    # -- requests ------------------------------------------------------------------
    async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        """Stream a request's events; the last is a finished TokenDelta or a RequestFailed."""
        self._bind()
        request_id = job.request.request_id
        if self._prepare is not None and job.request.sampling.structured is not None:
            try:
                await asyncio.to_thread(self._prepare, job.request)
            except InvalidRequestError as e:
                yield RequestFailed(request_id, FailureKind.INVALID, str(e), e.param)
                return
        events: asyncio.Queue[WorkerEvent | ChannelClosed] = asyncio.Queue()
        self._streams[request_id] = events
        self._loop.submit(job)
        reader = Coalesced(events)
        finished = False
        try:
            while not finished:
                event = await reader.get()
                if isinstance(event, ChannelClosed):  # only a channel's queues get one
                    raise RuntimeError(event.cause)
                finished = is_final(event)
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (client hung up, cancelled)
                self._loop.abort(request_id)

    async def channel_address(self) -> ChannelAddress:
        """Where this worker's socket channel listens, and its secret (it starts listening
        on the first call, on this worker's event loop)."""
        self._bind()
        if self._server is None:
            self._server = ChannelServer(self, node_ip_address())
        return await self._server.start()

    async def events(self, subscriber: str) -> AsyncIterator[EventBatch]:
        """One gateway's channel through Ray: a batch of events per engine step, for every
        request that gateway ``submit``-ted here. Ending it (the gateway went away) aborts
        them."""
        self._bind()
        outbox = self.open_outbox(subscriber)
        try:
            while True:
                yield await outbox.next_batch()
        finally:
            self.close_outbox(subscriber)

    async def submit(self, subscriber: str, job: Job) -> None:
        """Run ``job``; its events go to ``subscriber``'s channel (``events``)."""
        preparing = self._own_and_submit(subscriber, job)
        if preparing is not None:
            await asyncio.shield(preparing)

    def submit_soon(self, subscriber: str, job: Job) -> None:
        """``submit`` without waiting: the request is owned by ``subscriber`` when this
        returns, so an abort read right after it finds it. A grammar compiles off the loop."""
        self._own_and_submit(subscriber, job)

    def _own_and_submit(self, subscriber: str, job: Job) -> asyncio.Task[None] | None:
        self._bind()
        request_id = job.request.request_id
        outbox = self.open_outbox(subscriber)
        outbox.request_ids.add(request_id)
        self._owners[request_id] = outbox
        if self._prepare is None or job.request.sampling.structured is None:
            self._loop.submit(job)
            return None
        task = asyncio.get_running_loop().create_task(self._prepare_then_submit(job))
        self._preparing.add(task)  # a reference, so the task is not collected mid-way
        task.add_done_callback(self._preparing.discard)
        return task

    async def _prepare_then_submit(self, job: Job) -> None:
        request_id = job.request.request_id
        assert self._prepare is not None
        try:
            await asyncio.to_thread(self._prepare, job.request)
        except InvalidRequestError as e:
            self._route_events((RequestFailed(request_id, FailureKind.INVALID, str(e), e.param),))
            return
        if request_id in self._owners:  # not aborted while its grammar compiled
            self._loop.submit(job)

    def open_outbox(self, subscriber: str) -> Outbox:
        # ``submit`` may run before ``events`` (two calls racing): whichever comes first makes it.
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            outbox = self._outboxes[subscriber] = Outbox()
        return outbox

    def close_outbox(self, subscriber: str) -> None:
        """The subscriber's channel ended (the gateway went away): abort its requests."""
        outbox = self._outboxes.pop(subscriber, None)
        if outbox is None:
            return
        for request_id in list(outbox.request_ids):
            self._owners.pop(request_id, None)
            self._loop.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks, held ones included. Idempotent."""
        self._forget(request_id)
        self._loop.abort(request_id)

    def _forget(self, request_id: str) -> None:
        outbox = self._owners.pop(request_id, None)
        if outbox is not None:
            outbox.request_ids.discard(request_id)

    def abort_soon(self, request_id: str) -> None:
        """``abort`` for callers in this process that cannot await."""
        self._forget(request_id)
        self._loop.abort(request_id)

    # -- telemetry and control ---------------------------------------------------------
    async def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        """Yield a snapshot whenever the engine loop publishes one (>= every interval)."""
        self._bind()
        wake = asyncio.Event()
        self._subscribers.add(wake)
        last_seq = -1
        try:
            while True:
                await wake.wait()
                wake.clear()
                latest = self._latest
                if latest is not None and latest.seq != last_seq:
                    last_seq = latest.seq
                    yield latest
        finally:
            self._subscribers.discard(wake)

    async def snapshot(self) -> WorkerSnapshot:
        """A fresh snapshot, taken by the engine loop now."""
        return await asyncio.wrap_future(self._loop.snapshot())

    async def ping(self) -> str:
        """Liveness: the actor answers *and* its engine loop is beating."""
        stalled_s = self._loop.stalled_for_s()
        if stalled_s > self._stall_timeout_s:
            raise EngineStalledError(
                f"worker {self.worker_id}: engine loop silent for {stalled_s:.1f} s"
            )
        return self.worker_id

    async def role(self) -> Role:
        return self._role

    async def set_role(self, role: Role, drain_timeout_s: float = 30.0) -> Role:
        """Drain (stop taking work, let in-flight requests finish), then switch role;
        the role it has after. A worker keeps its own, undrained, where it cannot take
        ``role``: a fixed-role one, or the encode role on an engine that cannot encode
        (vLLM's). To a role that takes all its work (prefill or decode to mixed) it
        switches at once: what it has in flight goes on, and it takes new work
        meanwhile (drained, a prefill worker becoming mixed under a queue of long
        prompts would take nothing new until the last of them had prefilled)."""
        if self._fixed_role or (
            role is Role.ENCODE and role is not self._role and not self._loop.can_encode
        ):
            return self._role
        if role.does_all_of(self._role):
            self._role = role
            self._loop.mark_dirty()
            return role
        self._draining = True
        self._loop.mark_dirty()
        deadline = time.monotonic() + drain_timeout_s
        while (self._streams or self._owners) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._role = role
        self._draining = False
        self._loop.mark_dirty()
        return role

    async def shutdown(self) -> None:
        self._close_server()
        self._loop.stop()

    def _close_server(self) -> None:
        if self._server is not None and self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._server.close)

    def stop_now(self) -> None:
        """Stop without draining (the controller gave up on this worker): every open
        stream ends with a failure, so its request is re-placed, not left waiting."""
        self._close_server()
        self._loop.stop()
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(
                RequestFailed(request_id, FailureKind.INTERNAL, f"worker {self.worker_id} stopped")
            )

    # -- from the engine thread --------------------------------------------------------
    def _bind(self) -> None:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()

    def _post_events(self, events: tuple[WorkerEvent, ...]) -> None:
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._route_events, events)

    def _route_events(self, events: tuple[WorkerEvent, ...]) -> None:
        """One engine iteration's events: to in-process streams, or to the channels'
        outboxes, each woken once (so each channel sends one batch for the step)."""
        woken: list[Outbox] = []
        for event in events:
            request_id = event.request_id
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(event)
                continue
            outbox = self._owners.get(request_id)
            if outbox is None:
                continue  # aborted: nobody listens
            outbox.put(event)
            if is_final(event):
                del self._owners[request_id]
            if outbox not in woken:
                woken.append(outbox)
        for outbox in woken:
            outbox.wake()

    def _post_snapshot(self, snapshot: WorkerSnapshot) -> None:
        self._latest = snapshot
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._wake_subscribers)

    def _wake_subscribers(self) -> None:
        for wake in self._subscribers:
            wake.set()
