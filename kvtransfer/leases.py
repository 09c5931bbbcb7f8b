"""Holder-side bookkeeping: which blocks are lent, until when, and who frees them.

A hold lives until one of: the puller reports completion, the holder calls
``release``, or the lease expires. Whichever comes first fires ``on_release``
exactly once, on the thread that calls into the table (the holder's loop), never
on a background thread. While a two-sided backend is still sending a hold's
bytes the hold is *pinned*: expiry waits and an explicit release is deferred
until the send ends, so the holder can never reuse blocks that are being read.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtransfer.connector import ReleaseCallback

__all__ = ["Hold", "LeaseTable"]


@dataclass(slots=True)
class Hold:
    transfer_id: str
    region: str
    block_ids: tuple[int, ...]
    expires_at_s: float
    on_release: ReleaseCallback | None
    slot: int = -1  # backend-specific (NIXL lease-board slot)
    num_pins: int = 0
    released: bool = False  # refused to new pulls; callback may still be pending on a pin


class LeaseTable:
    """Thread-safe table of holds keyed by transfer id."""

    def __init__(
        self, clock: Callable[[], float], on_free: Callable[[Hold], None] | None = None
    ) -> None:
        self._clock = clock
        self._on_free = on_free  # backend hook that runs before the holder's callback
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}

    def add(
        self,
        region: str,
        block_ids: Sequence[int],
        lease_s: float,
        on_release: ReleaseCallback | None,
        slot: int = -1,
    ) -> Hold:
        hold = Hold(
            transfer_id=uuid.uuid4().hex,
            region=region,
            block_ids=tuple(int(b) for b in block_ids),
            expires_at_s=self._clock() + lease_s,
            on_release=on_release,
            slot=slot,
        )
        with self._lock:
            self._holds[hold.transfer_id] = hold
        return hold

    def get(self, transfer_id: str) -> Hold | None:
        """The live hold, or None when it was released, expired or never existed."""
        with self._lock:
            hold = self._holds.get(transfer_id)
            return None if hold is None or hold.released else hold

    def pin(self, transfer_id: str) -> Hold | None:
        """Keep a live hold's blocks from being freed while bytes are sent from them."""
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is None or hold.released:
                return None
            hold.num_pins += 1
            return hold

    def unpin(self, transfer_id: str) -> None:
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is not None:
                hold.num_pins -= 1

    def release(self, transfer_id: str) -> bool:
        """Refuse further pulls and free the blocks now or, if pinned, on a later call.

        Idempotent. Returns True when this call fired the callback.
        """
        with self._lock:
            hold = self._holds.get(transfer_id)
            if hold is None:
                return False
            hold.released = True
            if hold.num_pins > 0:
                return False
            del self._holds[transfer_id]
        self._fire(hold)
        return True

    def collect(self) -> list[Hold]:
        """Fire callbacks for expired holds and deferred releases; return the freed holds."""
        now = self._clock()
        with self._lock:
            due = [
                h
                for h in self._holds.values()
                if h.num_pins == 0 and (h.released or h.expires_at_s <= now)
            ]
            for hold in due:
                hold.released = True
                del self._holds[hold.transfer_id]
        for hold in due:
            self._fire(hold)
        return due

    def release_all(self) -> None:
        with self._lock:
            holds = list(self._holds.values())
            self._holds.clear()
        for hold in holds:
            hold.released = True
            self._fire(hold)

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    def _fire(self, hold: Hold) -> None:
        if self._on_free is not None:
            self._on_free(hold)
        if hold.on_release is not None:
            hold.on_release(hold.block_ids)
