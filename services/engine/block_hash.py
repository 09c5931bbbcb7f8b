"""Chained hashes of full KV blocks: the names the prefix cache and the router share.

A block is named by ``hash(parent block's name, its token ids)``, so equal names
mean equal token prefixes. The engine names its cached blocks this way; the
gateway names a prompt's blocks the same way to find which worker caches a
prefix of it (``RequestProfile.prefix_hashes`` against ``WorkerView.prefix_digest``).
Torch-free, so the gateway can import it without the engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["compute_block_hashes", "hash_block", "image_hash_token_ids"]


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """128-bit chained hash of one full block: stable across processes (unlike ``hash``)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent_hash or 0).to_bytes(16, "little"))
    h.update(b"\x01" if parent_hash is not None else b"\x00")
    # Each token as 8 little-endian signed bytes, packed in one call.
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` (chained on ``parent``)."""
    hashes: list[int] = []
    for b in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes


def image_hash_token_ids(
    token_ids: Sequence[int], images: Sequence[tuple[int, int, str]]
) -> list[int]:
    """``token_ids`` with each image's placeholder run read as its content, for hashing.

    ``images`` are ``(offset, num_tokens, content_hash hex)``. Every placeholder of an
    image becomes the same negative number drawn from its hash (token ids are never
    negative), so two prompts that differ only in an image never share a block name.
    """
    out = list(token_ids)
    for offset, num_tokens, content_hash in images:
        digest = hashlib.blake2b(content_hash.encode(), digest_size=8).digest()
        value = -1 - (int.from_bytes(digest, "little") >> 2)  # fits a signed 64-bit pack
        out[offset : offset + num_tokens] = [value] * num_tokens
    return out
