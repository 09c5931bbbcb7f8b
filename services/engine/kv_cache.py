"""Paged KV cache bookkeeping: a pool of fixed-size blocks, reference counts, prefix cache.

The pool tensor itself (``kv[num_blocks, *layout.block_shape]``) is allocated by
``allocate_kv_pool``; ``BlockManager`` only decides which block ids a request owns.

Prefix caching: every FULL block is named by a chained hash of (parent block's
hash, the block's token ids), so equal hashes mean equal token prefixes. When a
request is admitted, the leading blocks whose hashes are already cached are
shared (reference count + 1) instead of recomputed. A block whose count drops to
zero keeps its hash and stays reusable until free blocks run out; then cached
blocks are evicted least-recently-freed first. Uncached free blocks are always
used before any cached block is evicted.

Paired methods: ``can_allocate``/``allocate`` (admission, with prefix hits),
``can_append``/``append`` (grow for the next chunk or decode token), ``free``.
``hold``/``release_held`` keep a finished prefill's blocks for a remote puller.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.memory import alloc_region
from kvtransfer.types import KVLayout
from services.engine.block_hash import compute_block_hashes, hash_block

__all__ = ["BlockManager", "allocate_kv_pool", "compute_block_hashes", "hash_block"]

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def allocate_kv_pool(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """The preallocated pool ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``."""
    # Allocated by the transfer layer: on CPU it asks for huge pages before first touch,
    # which roughly doubles cross-process pull speed (kvtransfer/memory.py).
    shape = (num_blocks, *layout.block_shape)
    return alloc_region(shape, _TORCH_DTYPES[layout.dtype], layout.device)


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class _Table:
    """One request's blocks, in order, and the hashes of its leading full blocks."""

    block_ids: list[int]
    block_hashes: list[int]  # hashes of block_ids[: len(block_hashes)] (all registered or seen)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, _Table] = {}
        self._held: dict[str, list[int]] = {}
        self.num_evictions = 0
        self._digest_version = 0  # moves whenever ``_cached`` gains or loses a hash
        # ((version, limit), hashes) as last built
        self._digest: tuple[tuple[int, int], tuple[int, ...]] = ((0, 0), ())

    # -- counters ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix reuse (a subset of the free ones)."""
        return len(self._free_cached)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self._held.values())

    def cached_hashes(self, limit: int) -> tuple[int, ...]:
        """Hashes of the cached full blocks (in use or reusable), the ``limit`` most
        recently cached; rebuilt only when the cache changed since the last call."""
        key, hashes = self._digest
        if key != (self._digest_version, limit):
            keys = list(self._cached)
            hashes = tuple(keys[-limit:]) if limit > 0 else ()
            self._digest = ((self._digest_version, limit), hashes)
        return hashes

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables[request_id].block_ids

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission --------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute.

        The last token is always recomputed: its logits are what the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hits: list[int] = []
        parent: int | None = None
        for b in range(max_blocks):
            parent = hash_block(parent, token_ids[b * self.block_size : (b + 1) * self.block_size])
            block_id = self._cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, token_ids: Sequence[int], num_new_tokens: int) -> bool:
        """Whether ``allocate`` would succeed (prefix hits count as already there)."""
        hits = self.find_cached_prefix(token_ids)
        num_hit_free = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return needed + num_hit_free <= self.num_free_blocks

    def allocate(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int) -> int:
        """Give a request its prefix hits plus blocks for ``num_new_tokens`` more; return hit tokens.

        ``num_new_tokens`` counts tokens after the cached prefix. Call ``can_allocate`` first.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        if not self.can_allocate(token_ids, num_new_tokens):
            raise RuntimeError("allocate without room; call can_allocate first")
        hits = self.find_cached_prefix(token_ids)
        for b in hits:
            self._take(b)
        hashes = [self._blocks[b].block_hash for b in hits]
        table = _Table(list(hits), [h for h in hashes if h is not None])
        self._tables[request_id] = table
        num_hit_tokens = len(hits) * self.block_size
        self._grow(table, num_hit_tokens + num_new_tokens)
        return num_hit_tokens

    def allocate_exact(self, request_id: str, num_tokens: int) -> list[int]:
        """Fresh blocks for ``num_tokens`` whose KV will arrive from elsewhere (no prefix hits)."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        if self.blocks_needed(num_tokens) > self.num_free_blocks:
            raise RuntimeError("allocate_exact without room")
        table = _Table([], [])
        self._tables[request_id] = table
        self._grow(table, num_tokens)
        return list(table.block_ids)

    # -- growth -----------------------------------------------------------------
    def can_append(self, request_id: str, num_total_tokens: int) -> bool:
        """Whether the request's blocks can grow to cover ``num_total_tokens`` tokens."""
        table = self._tables[request_id]
        return self.blocks_needed(num_total_tokens) - len(table.block_ids) <= self.num_free_blocks

    def append(self, request_id: str, num_total_tokens: int) -> None:
        if not self.can_append(request_id, num_total_tokens):
            raise RuntimeError("append without room; call can_append first")
        self._grow(self._tables[request_id], num_total_tokens)

    def cache_full_blocks(
        self, request_id: str, token_ids: Sequence[int], num_computed: int
    ) -> None:
        """Register the hashes of blocks now full of computed KV, so later requests can share them."""
        table = self._tables[request_id]
        num_full = min(num_computed // self.block_size, len(table.block_ids))
        start = len(table.block_hashes)
        if not self.enable_prefix_caching or num_full <= start:
            return
        parent = table.block_hashes[-1] if table.block_hashes else None
        for h in compute_block_hashes(
            token_ids[: num_full * self.block_size], self.block_size, start, parent
        ):
            block = self._blocks[table.block_ids[len(table.block_hashes)]]
            table.block_hashes.append(h)
            # A twin computed the same content first: keep its entry, this block stays unnamed.
            if h not in self._cached and block.block_hash is None:
                block.block_hash = h
                self._cached[h] = block.block_id
                self._digest_version += 1

    # -- release ----------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Drop a request's references; its cached blocks stay reusable (tail ones evicted first)."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self._release(table.block_ids)

    def hold(self, request_id: str) -> list[int]:
        """Keep a finished request's blocks (still referenced) until ``release_held``."""
        table = self._tables.pop(request_id)
        self._held[request_id] = table.block_ids
        return list(table.block_ids)

    def release_held(self, request_id: str) -> bool:
        block_ids = self._held.pop(request_id, None)
        if block_ids is None:
            return False
        self._release(block_ids)
        return True

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def reset_prefix_cache(self) -> None:
        """Forget every unreferenced cached block (used after KV bytes were overwritten)."""
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._uncache(self._blocks[block_id])
            self._free_uncached.append(block_id)

    # -- internals --------------------------------------------------------------
    def _grow(self, table: _Table, num_total_tokens: int) -> None:
        for _ in range(self.blocks_needed(num_total_tokens) - len(table.block_ids)):
            table.block_ids.append(self._pop_free())

    def _pop_free(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._uncache(self._blocks[block_id])
            self.num_evictions += 1
        self._blocks[block_id].ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _release(self, block_ids: list[int]) -> None:
        # Reverse order: a prefix's tail is less likely to be shared, so it is evicted first.
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_uncached.append(block_id)

    def _uncache(self, block: _Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self._digest_version += 1
        block.block_hash = None
