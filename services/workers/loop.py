"""The engine loop: the one thread that touches a worker's engine and connector.

Engines and connectors are not thread-safe, so everything that reaches them is
a command on a queue, applied by this thread between steps::

    while running:
        apply commands         add / adopt+pull / encode / pull images / abort /
                               release held / snapshot
        progress transfers     connector.progress(); poll pulls; start adopted;
                               add requests whose image embeddings landed
        step the engine        while it has work
        deliver outputs        hold finished prefills; events to the outbox
        send events            one ``on_events`` call per iteration, every request's
        publish telemetry      after admissions and finishes, and every interval

Results leave through two callbacks (``on_events``, ``on_snapshot``) that the
asyncio side of the worker turns into stream items: one call carries all the
events of an iteration, so a step of 16 decoding requests crosses the thread
(and then the process) boundary once, not 16 times.

The loop makes every engine call; the books of what is moving live beside it, each
called only from this thread: KV pulls and holds in transfers.py, image embeddings in
images.py, and when to publish a snapshot in telemetry.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from kvtransfer.connector import KVConnector
from kvtransfer.types import BlockHandle, TransferState
from router.types import Role
from services.backends.protocol import Engine
from services.engine.messages import (
    EngineError,
    EngineRequest,
    InvalidRequestError,
    RequestOutput,
)
from services.workers.images import ImageStage
from services.workers.messages import (
    Continue,
    Encode,
    FailureKind,
    Generate,
    Job,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
    WorkerSnapshot,
)
from services.workers.priority import RolePriority
from services.workers.telemetry import SnapshotPublisher
from services.workers.transfers import KVTransfers

__all__ = ["EngineLoop"]

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.0005  # while a pull is in flight
_HELD_POLL_S = 0.01  # an engine that moves its own KV holds blocks for a decoder


@dataclass(frozen=True, slots=True)
class _Submit:
    job: Job


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _ReleaseHeld:
    request_id: str


@dataclass(frozen=True, slots=True)
class _TakeSnapshot:
    reply: Future[WorkerSnapshot]


_Command = _Submit | _Abort | _ReleaseHeld | _TakeSnapshot


class EngineLoop:
    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        connector: KVConnector | None,
        *,
        on_events: Callable[[tuple[WorkerEvent, ...]], None],
        on_snapshot: Callable[[WorkerSnapshot], None],
        role_state: Callable[[], tuple[Role, bool]],
        telemetry_interval_s: float,
        max_num_seqs: int = 256,
        nice: int = 0,
        prefill_nice: int | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._role_state = role_state
        # None: prefill engines run at the same nice value as the others.
        self._priority = RolePriority(
            worker_id, nice, nice if prefill_nice is None else prefill_nice
        )
        self._engine = engine
        self._connector = connector
        self._on_events = on_events
        self._outbox: list[WorkerEvent] = []  # this iteration's events, sent together
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._active: set[str] = set()  # in the engine: waiting, running or adopting
        # KV blocks (region "kv"): pulled here as a decode worker, held here as a
        # prefill worker (services/workers/transfers.py).
        self._kv = KVTransfers(worker_id, engine, connector, on_release=self._release_held)
        # The encode role's embeddings (region "mm"): held here as an encode worker,
        # pulled here as a prefill worker (services/workers/images.py).
        self._images = ImageStage(worker_id, engine, connector)
        self._telemetry = SnapshotPublisher(
            worker_id,
            engine,
            on_snapshot=on_snapshot,
            role_state=role_state,
            num_pending_pulls=self._num_pending_pulls,
            interval_s=telemetry_interval_s,
            max_num_seqs=max_num_seqs,
        )
        self._beat_s = time.monotonic()  # the loop's heartbeat: set every iteration
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)

    # -- called from any thread ------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=5)

    @property
    def can_encode(self) -> bool:
        """The worker can take the encode role (fixed at start)."""
        return self._images.can_encode

    def stalled_for_s(self) -> float:
        """Seconds since the loop last went round (inf once its thread has ended)."""
        if self._thread.ident is not None and not self._thread.is_alive():
            return float("inf")
        return time.monotonic() - self._beat_s

    def submit(self, job: Job) -> None:
        self._put(_Submit(job))

    def abort(self, request_id: str) -> None:
        self._put(_Abort(request_id))

    def snapshot(self) -> Future[WorkerSnapshot]:
        reply: Future[WorkerSnapshot] = Future()
        self._put(_TakeSnapshot(reply))
        return reply

    def mark_dirty(self) -> None:
        """Publish a snapshot soon (the role changed)."""
        self._put(_TakeSnapshot(Future()))

    def _put(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the loop ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._beat_s = time.monotonic()
            self._priority.follow(self._role_state()[0])
            try:
                self._apply_commands()
                self._progress_transfers()
                outputs = self._step()
                self._deliver(outputs)
                self._send_events()
                self._telemetry.publish_if_due()
            except Exception as e:
                self._recover(e)
                self._send_events()
                continue
            if not outputs:
                self._wait_for_work()
        if self._connector is not None:
            self._connector.close()

    def _recover(self, error: Exception) -> None:
        """An engine step (or a command) raised: the loop goes on.

        The step's batch cannot be told apart, so every request in the engine fails with
        INTERNAL; the gateway re-places each from its committed tokens (greedy text
        unchanged) and the worker keeps serving.
        """
        log.exception(
            "worker %s: engine loop error; failing its in-flight requests", self._worker_id
        )
        message = f"engine error: {type(error).__name__}: {error}"
        for request_id in list(self._active):
            try:
                self._engine.abort(request_id)
            except Exception:
                log.exception("worker %s: abort of %s failed", self._worker_id, request_id)
            self._fail(request_id, FailureKind.INTERNAL, message)
        self._active.clear()
        self._kv.clear_pulls()
        self._telemetry.touch()

    def _step(self) -> list[RequestOutput]:
        if self._engine.has_unfinished():
            return self._engine.step()
        if self._own_holds():
            self._engine.step()  # lets the engine expire leases and serve pulls
        return []

    def _own_holds(self) -> bool:
        return self._kv.moves_own_kv and bool(getattr(self._engine, "holds_blocks", bool)())

    def _wait_for_work(self) -> None:
        if self._num_pending_pulls():
            timeout_s = _IDLE_POLL_S
        elif self._engine.has_unfinished():
            timeout_s = 0.001  # blocked on capacity: look again soon
        elif self._own_holds():
            timeout_s = _HELD_POLL_S
        else:
            timeout_s = max(0.0, self._telemetry.next_publish_s() - time.monotonic())
        self._wake.wait(timeout_s)
        self._wake.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case _Submit(job=Generate(images=BlockHandle()) as job):
                    self._pull_images(job)
                case _Submit(job=Generate(request=request)):
                    self._add(request)
                case _Submit(job=Encode(request=request)):
                    self._emit(self._images.encode(request))
                    self._telemetry.touch()
                case _Submit(job=Continue() as job):
                    self._adopt_and_pull(job)
                case _Abort(request_id=request_id):
                    self._abort(request_id)
                case _ReleaseHeld(request_id=request_id):
                    self._kv.forget_hold(request_id)
                    self._engine.release_held(request_id)
                    self._telemetry.touch()
                case _TakeSnapshot(reply=reply):
                    reply.set_result(self._telemetry.take())
                    self._telemetry.touch()

    def _add(self, request: EngineRequest) -> None:
        request_id = request.request_id
        try:
            self._engine.add_request(request)
        except InvalidRequestError as e:
            self._fail(request_id, FailureKind.INVALID, str(e), e.param)
            return
        except EngineError as e:
            self._fail(request_id, FailureKind.CAPACITY, str(e))
            return
        self._active.add(request_id)
        self._telemetry.touch()

    def _pull_images(self, job: Generate) -> None:
        failed = self._images.start_pull(job)
        if failed is not None:
            self._emit(failed)

    def _adopt_and_pull(self, job: Continue) -> None:
        request_id = job.request.request_id
        if self._kv.moves_own_kv:
            self._add(replace(job.request, remote_kv=job.handle.payload))
            if request_id in self._active:
                self._kv.expect_own_pull(job)
            return
        if self._connector is None:
            self._fail(request_id, FailureKind.INTERNAL, "this worker has no KV connector")
            return
        try:
            block_ids = self._engine.adopt(job.request)
        except InvalidRequestError as e:
            self._fail(request_id, FailureKind.INVALID, str(e), e.param)
            return
        except EngineError as e:
            self._fail(request_id, FailureKind.CAPACITY, str(e))
            return
        self._active.add(request_id)
        failed = self._kv.pull(job, block_ids)
        if failed is not None:
            self._engine.abort(request_id)
            self._active.discard(request_id)
            self._emit(failed)

    def _abort(self, request_id: str) -> None:
        if request_id in self._active:
            self._engine.abort(request_id)
            self._active.discard(request_id)
            self._telemetry.touch()
        self._kv.abort(request_id)  # a hold's release fires on_release -> _ReleaseHeld
        self._images.abort(request_id)

    def _progress_transfers(self) -> None:
        if self._connector is None:
            return
        # A failed transfer fails its request, never the engine: the gateway re-places
        # it from its committed tokens.
        for pull, state in self._kv.progress():
            if state is TransferState.DONE:
                self._engine.start_adopted(pull.request_id)
                self._emit(pull.landed())
            else:
                self._engine.abort(pull.request_id)
                self._active.discard(pull.request_id)
                self._fail(pull.request_id, FailureKind.TRANSFER, "KV pull failed or timed out")
        for ended in self._images.progress():
            self._emit(ended.event)
            if ended.request is not None:
                self._add(ended.request)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            handle = None
            pulled = self._kv.own_pull_landed(out.request_id)
            if pulled is not None:
                self._emit(pulled)
            if out.remote_kv is not None:
                handle = self._kv.remote_handle(out.request_id, out.remote_kv)
            elif out.held_kv is not None:
                handle = self._hold(out.request_id, out.held_kv.block_ids)
                if handle is None:
                    continue
            if out.finished:
                self._active.discard(out.request_id)
                self._telemetry.count_finished()
            self._emit(_to_delta(out, handle, self._worker_id))

    def _hold(self, request_id: str, block_ids: Sequence[int]) -> BlockHandle | None:
        if self._connector is None:
            self._engine.release_held(request_id)
            self._fail(request_id, FailureKind.INTERNAL, "prefill-only needs a KV connector")
            return None
        return self._kv.hold(request_id, block_ids)

    def _release_held(self, request_id: str) -> None:
        # A hold ended, maybe on the connector's thread: the engine is only touched
        # from the loop, so queue it.
        self._put(_ReleaseHeld(request_id))

    def _num_pending_pulls(self) -> int:
        return self._kv.num_pending_pulls + self._images.num_pending_pulls

    def _emit(self, event: WorkerEvent) -> None:
        self._outbox.append(event)

    def _send_events(self) -> None:
        if self._outbox:
            events, self._outbox = tuple(self._outbox), []
            self._on_events(events)

    def _fail(
        self, request_id: str, kind: FailureKind, message: str, param: str | None = None
    ) -> None:
        self._emit(RequestFailed(request_id, kind, message, param))


def _to_delta(out: RequestOutput, handle: BlockHandle | None, worker_id: str) -> TokenDelta:
    return TokenDelta(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text="",
        finish_reason=out.finish_reason,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
        handle=handle,
        worker_id=worker_id,
    )
