"""The KVConnector protocol: how one process lends blocks and another pulls them.

Call order (``P`` holds the blocks, typically a prefill worker; ``D`` pulls,
typically a decode worker)::

    P: conn.register("kv", kv_tensor, layout)          once, at start-up
    D: conn.register("kv", kv_tensor, layout)          once, at start-up
    P: handle = conn.hold("kv", block_ids, on_release=free_fn)
         -> P keeps the blocks; the handle (small, picklable) goes to D
            through the gateway
    D: tid = conn.pull(handle, "kv", local_block_ids)
         -> D owns local_block_ids; bytes land there
    D: conn.poll(tid) -> PENDING | TRANSFERRING | DONE | FAILED   (repeat)
    P: conn.progress()   (called from P's loop) sees D's completion
         notification and calls free_fn(block_ids) exactly once
    P: conn.release(handle.transfer_id)   idempotent; also calls free_fn once

``progress()`` must be called regularly by any process that holds blocks (it
delivers completions and expires leases); ``on_release`` callbacks only ever
run inside ``progress()``, ``release()`` or ``close()``, on the caller's thread.

Ownership: until ``on_release`` fires, the holder's blocks belong to the
connector's lease and must not be reused by the holder. The puller's
``local_block_ids`` belong to the puller throughout; on ``FAILED`` it frees
them itself (the connector never keeps a reference to them after a final state).

Failure rules: a hold that nobody pulls is released when its lease
(``lease_s``, default 30 s) expires; a pull that does not finish within
``transfer_timeout_s`` (default 10 s), or whose holder died, becomes
``FAILED``; pulling a released or unknown handle raises ``UnknownHandleError``
(or ends ``FAILED`` if the holder is remote and only finds out then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvtransfer.types import BlockHandle, KVLayout, TransferState

__all__ = [
    "KVConnector",
    "KVTransferError",
    "ReleaseCallback",
    "ReportsOpenTransfers",
    "UnknownHandleError",
]

ReleaseCallback = Callable[[Sequence[int]], None]


class KVTransferError(RuntimeError):
    """Base class for KV-transfer errors."""


class UnknownHandleError(KVTransferError):
    """The handle names blocks that were released, expired or never held."""


@runtime_checkable
class KVConnector(Protocol):
    name: str  # backend name: "local", "nixl", "torch"
    agent_name: str  # unique per connector instance

    def register(self, region: str, tensor: Any, layout: KVLayout) -> None: ...

    def hold(
        self,
        region: str,
        block_ids: Sequence[int],
        *,
        lease_s: float | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> BlockHandle: ...

    def pull(self, handle: BlockHandle, region: str, local_block_ids: Sequence[int]) -> str: ...

    def poll(self, transfer_id: str) -> TransferState: ...

    def release(self, transfer_id: str) -> None: ...

    def progress(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ReportsOpenTransfers(Protocol):
    """Opt-in capability (every built-in backend has it): what a puller still holds.

    Counts pulls not yet final plus resources a finished pull has not yet given
    back (NIXL transfer handles NIXL could not cancel yet, torch pull threads
    still unwinding). Zero once everything a failure left behind is cleaned up.
    """

    def num_open_transfers(self) -> int: ...
