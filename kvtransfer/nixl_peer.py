"""What a NIXL puller needs to reach a hold, carried in ``BlockHandle.peer_info``.

JSON (the agent metadata base64-encoded) so any process can log or check it;
about 1 KB with one region registered.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from kvtransfer.connector import KVTransferError

__all__ = ["PeerInfo", "strided_rows"]


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a puller needs to reach a hold; JSON in ``BlockHandle.peer_info``."""

    metadata: bytes
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str
    device_id: int
    board_addr: int
    num_slots: int
    slot: int
    generation: int

    def encode(self) -> bytes:
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "metadata"}
        fields["metadata"] = base64.b64encode(self.metadata).decode()
        return json.dumps(fields, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> PeerInfo:
        try:
            fields = json.loads(raw)
            fields["metadata"] = base64.b64decode(fields["metadata"])
            return PeerInfo(**fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferError(f"malformed NIXL peer_info: {exc}") from exc


def strided_rows(addr: int, length: int, device_id: int, count: int) -> np.ndarray:
    """One Nx5 NIXL row: ``count`` descriptors of ``length`` bytes, back to back."""
    return np.array([[addr, length, device_id, length, count]], dtype=np.int64)
