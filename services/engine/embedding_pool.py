"""Image embeddings in a kvtransfer region: the encode worker's side of the hand-over.

An encode worker stores each image's embeddings ``[num_image_tokens, hidden]`` in one
slot of a pool registered with its connector as a second region (``MM_REGION``,
beside ``"kv"``), holds the slots under a lease and hands the ``BlockHandle`` on; the
prefill worker pulls them into slots of its own pool (one READ), loads them, and
frees its slots. Same lease, timeout and ``FAILED`` rules as KV blocks.

A slot is one kvtransfer block of ``KVLayout(num_layers=1, block_size=num_image_tokens,
num_kv_heads=1, head_dim=ceil(hidden / 2))``: the layout's K/V factor of two holds the
two halves of the hidden size, so a slot is ``num_image_tokens * hidden`` values (one
padding column when ``hidden`` is odd).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtransfer.types import KVLayout

__all__ = ["MM_REGION", "EmbeddingPool", "embedding_layout"]

MM_REGION = "mm"


def embedding_layout(
    num_image_tokens: int, hidden_size: int, dtype: torch.dtype, device: str = "cpu"
) -> KVLayout:
    return KVLayout(
        num_layers=1,
        block_size=num_image_tokens,
        num_kv_heads=1,
        head_dim=-(-hidden_size // 2),
        dtype=str(dtype).removeprefix("torch."),
        device=device,
    )


class EmbeddingPool:
    """``num_slots`` image-embedding slots: store / load / free, paired like a block manager."""

    def __init__(
        self,
        num_slots: int,
        num_image_tokens: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.num_image_tokens = num_image_tokens
        self.hidden_size = hidden_size
        self.layout = embedding_layout(num_image_tokens, hidden_size, dtype, device)
        self.storage = torch.zeros(
            (num_slots, *self.layout.block_shape), dtype=dtype, device=device
        )
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self, num_images: int) -> bool:
        return num_images <= len(self._free)

    def allocate(self, num_images: int) -> list[int]:
        """Slots for ``num_images`` (a puller's landing place); ValueError if there is no room."""
        if not self.can_allocate(num_images):
            raise ValueError(f"{num_images} slots asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(num_images)]

    def store(self, embeddings: torch.Tensor) -> list[int]:
        """``[N, num_image_tokens, hidden]`` -> the slots now holding them."""
        slots = self.allocate(embeddings.shape[0])
        for slot, image in zip(slots, embeddings):
            self._view(slot).copy_(image)
        return slots

    def load(self, slots: Sequence[int]) -> torch.Tensor:
        """A copy of the slots' embeddings, ``[N, num_image_tokens, hidden]``."""
        return torch.stack([self._view(slot).clone() for slot in slots])

    def free(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def _view(self, slot: int) -> torch.Tensor:
        n = self.num_image_tokens * self.hidden_size
        return self.storage[slot].view(-1)[:n].view(self.num_image_tokens, self.hidden_size)
