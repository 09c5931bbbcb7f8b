"""A worker's KV transfers: pulls into adopted blocks, and holds of finished prefills.

Owned by the engine loop (services/workers/loop.py) and called only from its thread,
like the engine and the connector. This class keeps the connector's side and the books
of what is in flight; the loop makes every engine call around it (adopt, start_adopted,
abort, release_held), so the engine is touched in one place. Call order::

    decode worker   pull(job, block_ids)      after engine.adopt: connector.pull into
                                              the adopted blocks (or a failure to send)
                    progress()                connector.progress(); the pulls that ended,
                                              DONE (the loop starts the request and sends
                                              ``Pull.landed()``) or FAILED (it aborts the
                                              request: a TRANSFER failure)
                    expect_own_pull(job)      an engine that moves its own KV (vLLM)
                    own_pull_landed(id)       pulls inside its step: the pull is done at
                                              the request's first output
    prefill worker  hold(id, block_ids)       a finished prefill's blocks under a
                                              connector lease -> its handle; ``on_release``
                                              (from any thread) when the puller is done,
                                              on abort, or when the lease expires
                    forget_hold(id)           the loop is releasing the engine's blocks
                    remote_handle(id, ...)    for an engine that moves its own KV: a
                                              handle with the engine's transfer parameters
    both            abort(id)                 drop the request's pulls; release its hold

A transfer error (NIXL's, torch's) fails the transfers it touches, never the engine.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.connector import KVConnector
from kvtransfer.types import BlockHandle, TransferState
from services.backends.protocol import Engine
from services.workers.messages import Continue, FailureKind, KVPulled, RequestFailed

__all__ = ["KV_REGION", "KVTransfers", "Pull"]

log = logging.getLogger(__name__)

KV_REGION = "kv"


@dataclass(slots=True)
class Pull:
    """A KV pull in flight (``transfer_id`` is empty where the engine pulls itself)."""

    request_id: str
    transfer_id: str
    num_bytes: int
    started_s: float

    def landed(self) -> KVPulled:
        """The event for this pull, done now."""
        return KVPulled(self.request_id, self.num_bytes, time.monotonic() - self.started_s)


class KVTransfers:
    """The ``kv`` region's pulls and holds; ``on_release(request_id)`` ends a hold."""

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        connector: KVConnector | None,
        *,
        on_release: Callable[[str], None],
    ) -> None:
        self._worker_id = worker_id
        self._engine = engine
        self._connector = connector
        self._on_release = on_release
        self._pulls: dict[str, Pull] = {}  # transfer_id -> pull
        self._own_pulls: dict[str, Pull] = {}  # request_id -> pull
        self._held: dict[str, str] = {}  # request_id -> transfer_id of its hold
        # An engine that moves its own KV (vLLM) pulls inside its step: a Continue is
        # an add_request with the handle's payload, and the pull counts as done at the
        # request's first output.
        self.moves_own_kv = bool(getattr(engine, "moves_own_kv", False))
        if connector is not None and not self.moves_own_kv:
            connector.register(KV_REGION, engine.kv_storage, engine.kv_layout)

    @property
    def num_pending_pulls(self) -> int:
        return len(self._pulls)

    # -- decode worker --------------------------------------------------------------
    def pull(self, job: Continue, block_ids: Sequence[int]) -> RequestFailed | None:
        """Pull ``job``'s KV into its adopted ``block_ids``; a failure to send, or None."""
        assert self._connector is not None
        request_id = job.request.request_id
        try:
            transfer_id = self._connector.pull(job.handle, KV_REGION, block_ids)
        except Exception as e:  # KVTransferError, or NIXL's or torch's own: this request only
            return RequestFailed(request_id, FailureKind.TRANSFER, f"KV pull failed: {e}")
        num_bytes = len(job.handle.block_ids) * job.handle.layout.block_bytes
        self._pulls[transfer_id] = Pull(request_id, transfer_id, num_bytes, time.monotonic())
        return None

    def progress(self) -> list[tuple[Pull, TransferState]]:
        """Advance the connector; the pulls that ended, each with its final state."""
        connector = self._connector
        if connector is None:
            return []
        try:
            connector.progress()
        except Exception:
            log.exception("worker %s: KV connector progress failed", self._worker_id)
            failed: TransferState | None = TransferState.FAILED
        else:
            failed = None
        ended: list[tuple[Pull, TransferState]] = []
        for transfer_id, pull in list(self._pulls.items()):
            try:
                state = failed or connector.poll(transfer_id)
            except Exception:
                log.exception("worker %s: polling transfer %s failed", self._worker_id, transfer_id)
                state = TransferState.FAILED
            if state.is_final:
                del self._pulls[transfer_id]
                ended.append((pull, state))
        return ended

    def expect_own_pull(self, job: Continue) -> None:
        """The engine pulls ``job``'s KV itself; timed from now to its first output."""
        request_id = job.request.request_id
        num_bytes = len(job.request.prompt_token_ids) * _bytes_per_token(job.handle)
        self._own_pulls[request_id] = Pull(request_id, "", num_bytes, time.monotonic())

    def own_pull_landed(self, request_id: str) -> KVPulled | None:
        """The request has an output: the event for its own pull, if one was awaited."""
        pull = self._own_pulls.pop(request_id, None)
        return None if pull is None else pull.landed()

    def clear_pulls(self) -> None:
        """Forget every pull (the loop failed their requests)."""
        self._pulls.clear()
        self._own_pulls.clear()

    # -- prefill worker -------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Sequence[int]) -> BlockHandle:
        """Hold a finished prefill's blocks for a puller; the handle it pulls with."""
        assert self._connector is not None
        on_release = functools.partial(self._released, request_id)
        handle = self._connector.hold(KV_REGION, block_ids, on_release=on_release)
        self._held[request_id] = handle.transfer_id
        return handle

    def _released(self, request_id: str, _block_ids: Sequence[int]) -> None:
        # The connector may call this from its own thread: the engine is only touched
        # from the loop, which queues it.
        self._on_release(request_id)

    def forget_hold(self, request_id: str) -> None:
        """The request's hold ended (the loop releases the engine's blocks)."""
        self._held.pop(request_id, None)

    def remote_handle(self, request_id: str, payload: Mapping[str, Any]) -> BlockHandle:
        """A handle that carries the engine's own transfer parameters (no block list)."""
        return BlockHandle(
            backend="engine",
            agent=self._worker_id,
            region=KV_REGION,
            transfer_id=request_id,
            block_ids=(),
            layout=self._engine.kv_layout,
            expires_at_s=0.0,  # the engine enforces its own lease
            payload=dict(payload),
        )

    # -- both -----------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Drop the request's pulls and release its hold (``on_release`` follows)."""
        self._own_pulls.pop(request_id, None)
        for transfer_id, pull in list(self._pulls.items()):
            if pull.request_id == request_id:
                del self._pulls[transfer_id]
        hold_id = self._held.get(request_id)
        if hold_id is not None and self._connector is not None:
            self._connector.release(hold_id)


def _bytes_per_token(handle: BlockHandle) -> int:
    return handle.layout.block_bytes // handle.layout.block_size
