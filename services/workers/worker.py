"""The worker: one class whose role (prefill, decode, mixed) is a mode, not a type.

``Worker`` is a plain class with async methods. ``services.workers.actor`` turns
it into a Ray actor; tests and the in-process benchmark use it directly. Its
engine runs continuously in an ``EngineLoop`` thread; this class is the asyncio
side: one queue per request stream and one event per telemetry subscriber.

Call order seen from the gateway::

    async for event in worker.generate(Generate(req) | Continue(req, handle)): ...
    worker.abort(request_id)                       any time; idempotent
    async for snapshot in worker.telemetry(): ...  one subscription per gateway
    await worker.set_role(Role.DECODE)             drains in-flight requests first
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvtransfer.connector import KVConnector
from router.types import Role
from services.backends.protocol import Engine
from services.engine.messages import EngineRequest, InvalidRequestError
from services.workers.loop import EngineLoop
from services.workers.messages import (
    FailureKind,
    Job,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
    WorkerSnapshot,
)

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


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.worker_id = spec.worker_id
        self._role = spec.role
        self._draining = False
        self._stall_timeout_s = spec.stall_timeout_s
        engine = spec.engine_factory()
        # Optional engine capability: thread-safe per-request work done before the
        # request reaches the engine loop (compiling its grammar), so that a slow
        # compile never stalls the other requests' steps.
        self._prepare: Callable[[EngineRequest], None] | None = getattr(engine, "prepare", None)
        connector = spec.connector_factory(spec.worker_id) if spec.connector_factory else None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[WorkerEvent]] = {}
        self._subscribers: set[asyncio.Event] = set()
        self._latest: WorkerSnapshot | None = None
        self._loop = EngineLoop(
            spec.worker_id,
            engine,
            connector,
            on_event=self._post_event,
            on_snapshot=self._post_snapshot,
            role_state=lambda: (self._role, self._draining),
            telemetry_interval_s=spec.telemetry_interval_s,
            max_num_seqs=spec.max_num_seqs,
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
        events: asyncio.Queue[WorkerEvent] = asyncio.Queue()
        self._streams[request_id] = events
        self._loop.submit(job)
        finished = False
        try:
            while not finished:
                event = _coalesce(await events.get(), events)
                finished = isinstance(event, RequestFailed) or (
                    isinstance(event, TokenDelta) and event.finish_reason is not None
                )
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer went away (client hung up, cancelled)
                self._loop.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks, held ones included. Idempotent."""
        self._loop.abort(request_id)

    def abort_soon(self, request_id: str) -> None:
        """``abort`` for callers in this process that cannot await."""
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
        """Drain (stop taking work, let in-flight requests finish), then switch role."""
        self._draining = True
        self._loop.mark_dirty()
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._role = role
        self._draining = False
        self._loop.mark_dirty()
        return role

    async def shutdown(self) -> None:
        self._loop.stop()

    def stop_now(self) -> None:
        """Stop without draining (the controller gave up on this worker): every open
        stream ends with a failure, so its request is re-placed, not left waiting."""
        self._loop.stop()
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(
                RequestFailed(request_id, FailureKind.INTERNAL, f"worker {self.worker_id} stopped")
            )

    # -- from the engine thread --------------------------------------------------------
    def _bind(self) -> None:
        if self._aio is None:
            self._aio = asyncio.get_running_loop()

    def _post_event(self, request_id: str, event: WorkerEvent) -> None:
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._route_event, request_id, event)

    def _route_event(self, request_id: str, event: WorkerEvent) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(event)

    def _post_snapshot(self, snapshot: WorkerSnapshot) -> None:
        self._latest = snapshot
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self._wake_subscribers)

    def _wake_subscribers(self) -> None:
        for wake in self._subscribers:
            wake.set()


def _coalesce(event: WorkerEvent, queued: asyncio.Queue[WorkerEvent]) -> WorkerEvent:
    """Merge token deltas that piled up behind ``event`` (only when the consumer lags).

    One stream item per engine step is the rule; under overload, one item per
    several steps costs one Ray round trip instead of several, and a delta is
    "everything since the last one" either way.
    """
    while isinstance(event, TokenDelta) and event.finish_reason is None and not queued.empty():
        follower = queued.get_nowait()
        if not isinstance(follower, TokenDelta):
            queued.put_nowait(follower)  # keep order: rare (a failure after tokens)
            break
        event = dataclasses.replace(
            follower,
            token_ids=event.token_ids + follower.token_ids,
            text=event.text + follower.text,
            logprobs=(event.logprobs or ()) + (follower.logprobs or ())
            if event.logprobs or follower.logprobs
            else None,
        )
    return event
