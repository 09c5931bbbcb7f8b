"""Registered memory regions and the argument checks every backend shares.

Every check here runs before a byte moves, so a bad call fails loudly at the
caller instead of corrupting a peer's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.connector import KVTransferError
from kvtransfer.leases import Hold
from kvtransfer.types import BlockHandle, KVLayout

__all__ = [
    "Region",
    "check_block_ids",
    "check_pull",
    "describe_hold",
    "lookup_region",
    "make_region",
]


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    tensor: torch.Tensor  # [num_blocks, *layout.block_shape], contiguous
    layout: KVLayout

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def base_addr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def is_cuda(self) -> bool:
        return self.tensor.device.type == "cuda"


def make_region(name: str, tensor: Any, layout: KVLayout) -> Region:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"region {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    expected = layout.block_shape
    if tensor.dim() != 1 + len(expected) or tuple(tensor.shape[1:]) != expected:
        raise ValueError(
            f"region {name!r}: tensor shape {tuple(tensor.shape)} is not [num_blocks, *{expected}]"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype != layout.dtype:
        raise ValueError(f"region {name!r}: tensor dtype {dtype} != layout dtype {layout.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"region {name!r}: tensor must be contiguous")
    return Region(name, tensor, layout)


def check_block_ids(region: Region, block_ids: Sequence[int]) -> None:
    if not block_ids:
        raise ValueError("no block ids")
    bad = [b for b in block_ids if not 0 <= b < region.num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:5]} out of range for region {region.name!r}")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError("duplicate block ids")


def check_pull(
    backend: str,
    regions: dict[str, Region],
    handle: BlockHandle,
    region: str,
    local_block_ids: Sequence[int],
) -> Region:
    """Validate a pull before any byte moves; return the local region."""
    if handle.backend != backend:
        raise KVTransferError(f"handle is for backend {handle.backend!r}, not {backend!r}")
    local = regions.get(region)
    if local is None:
        raise KeyError(f"region {region!r} is not registered")
    handle.layout.check_compatible(local.layout)
    if len(local_block_ids) != len(handle.block_ids):
        raise ValueError(
            f"{len(local_block_ids)} local blocks for {len(handle.block_ids)} held blocks"
        )
    check_block_ids(local, local_block_ids)
    return local


def lookup_region(regions: dict[str, Region], name: str) -> Region:
    """The registered region ``name``, or a KeyError that says it is not registered."""
    reg = regions.get(name)
    if reg is None:
        raise KeyError(f"region {name!r} is not registered")
    return reg


def describe_hold(
    backend: str, agent: str, reg: Region, hold: Hold, peer_info: bytes = b""
) -> BlockHandle:
    """The handle a holder gives out for one lease on ``reg``'s blocks."""
    return BlockHandle(
        backend=backend,
        agent=agent,
        region=reg.name,
        transfer_id=hold.transfer_id,
        block_ids=hold.block_ids,
        layout=reg.layout,
        expires_at_s=hold.expires_at_s,
        peer_info=peer_info,
    )
