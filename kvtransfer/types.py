"""Plain data that crosses process boundaries in the KV-transfer layer.

Everything here is a frozen, slotted dataclass so it pickles small and cannot be
mutated after it has been handed to another process.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BlockHandle", "KVLayout", "LayoutMismatchError", "TransferState"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1}


class LayoutMismatchError(ValueError):
    """Two KV layouts disagree on a field that must match before bytes move."""


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one transferable block.

    A KV region is one tensor of shape ``[num_blocks, *block_shape]`` where
    ``block_shape = (num_layers, 2, num_kv_heads, block_size, head_dim)``: block-major,
    so one block across every layer is a single contiguous span of
    ``block_bytes`` bytes (the fewest, largest descriptors to move), and heads
    come before tokens inside a block so a reader could later pull head slices.
    Non-KV buffers (encoder outputs) use ``num_layers=1, num_kv_heads=1``.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; expected one of {sorted(_DTYPE_BYTES)}"
            )
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.itemsize

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatchError naming every field that differs (device may differ)."""
        names = ("block_size", "dtype", "num_layers", "num_kv_heads", "head_dim")
        diffs = [
            f"{n}: {getattr(self, n)!r} != {getattr(other, n)!r}"
            for n in names
            if getattr(self, n) != getattr(other, n)
        ]
        if diffs:
            raise LayoutMismatchError("KV layout mismatch (" + "; ".join(diffs) + ")")


@dataclass(frozen=True, slots=True)
class BlockHandle:
    """A small, serialisable description of blocks held for a puller.

    ``peer_info`` carries what a backend needs to reach the holder (NIXL agent
    metadata, a rendezvous address); it travels with the handle through the
    gateway, so no extra side channel is needed between workers.
    """

    backend: str
    agent: str
    region: str
    transfer_id: str
    block_ids: tuple[int, ...]
    layout: KVLayout
    expires_at_s: float
    peer_info: bytes = b""
    extra: dict[str, str] = field(default_factory=dict)
    # For an engine that moves its own KV (vLLM): its transfer parameters, opaque to
    # Baton and handed to the decoding engine as they are. block_ids is then empty.
    payload: Mapping[str, Any] | None = None
