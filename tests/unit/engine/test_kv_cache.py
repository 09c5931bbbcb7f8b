"""Block manager: reference counts, prefix-cache hash chain, LRU eviction, holds."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.types import KVLayout
from services.engine.kv_cache import (
    BlockManager,
    allocate_kv_pool,
    compute_block_hashes,
    hash_block,
)

BS = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def fill(bm: BlockManager, rid: str, tokens: list[int], num_new: int | None = None) -> int:
    """Admit and 'compute' a request: allocate, then register its full blocks."""
    n = len(tokens) if num_new is None else num_new
    assert bm.can_allocate(tokens, n)
    hit = bm.allocate(rid, tokens, n)
    bm.cache_full_blocks(rid, tokens, len(tokens))
    return hit


def test_pool_shape_and_dtype_follow_the_layout() -> None:
    layout = KVLayout(num_layers=3, block_size=BS, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    kv = allocate_kv_pool(layout, 5)
    assert kv.shape == (5, 3, 2, 2, BS, 8)
    assert kv.dtype == torch.bfloat16
    assert kv[0].numel() * kv.element_size() == layout.block_bytes


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    a = compute_block_hashes(toks(12), BS)
    assert len(a) == 3
    assert a[1] == hash_block(a[0], toks(4, 4))
    # Same second block content after a different first block: a different hash.
    b = compute_block_hashes([99, 1, 2, 3, *toks(8, 4)], BS)
    assert b[0] != a[0] and b[1] != a[1] and b[2] != a[2]
    # A partial trailing block is not hashed; the hash is stable across calls.
    assert compute_block_hashes(toks(14), BS) == a
    # Resuming from a parent gives the same chain.
    assert compute_block_hashes(toks(12), BS, start=1, parent=a[0]) == a[1:]


def test_allocate_counts_blocks_and_free_returns_them() -> None:
    bm = BlockManager(8, BS)
    assert fill(bm, "a", toks(9)) == 0
    assert len(bm.block_ids("a")) == 3
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    # Its two full blocks stay cached (reusable); the partial one does not.
    assert bm.num_cached_blocks == 2


def test_shared_prefix_reuses_blocks_and_counts_references() -> None:
    bm = BlockManager(8, BS)
    prompt_a = [*toks(12), 100, 101]
    fill(bm, "a", prompt_a)
    prompt_b = [*toks(12), 200]
    hit = fill(bm, "b", prompt_b, num_new=1)
    assert hit == 12
    assert bm.block_ids("b")[:3] == bm.block_ids("a")[:3]
    assert bm.block_ids("b")[3] != bm.block_ids("a")[3]
    for block_id in bm.block_ids("a")[:3]:
        assert bm.ref_count(block_id) == 2
    bm.free("a")
    for block_id in bm.block_ids("b")[:3]:
        assert bm.ref_count(block_id) == 1
    assert bm.num_free_blocks == 8 - 4


def test_last_token_is_never_a_hit() -> None:
    bm = BlockManager(8, BS)
    fill(bm, "a", toks(8))
    bm.free("a")
    # An identical 8-token prompt may reuse only the first block: token 8's logits are needed.
    assert len(bm.find_cached_prefix(toks(8))) == 1
    assert len(bm.find_cached_prefix(toks(9))) == 2


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS)
    fill(bm, "old", [*toks(4, 1000), 0])  # 1 full cached block + 1 partial
    bm.free("old")
    fill(bm, "new", [*toks(4, 2000), 0])
    bm.free("new")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    # Needs 3 blocks: 2 uncached free ones, then evicts the oldest cached block.
    fill(bm, "c", toks(9, 5000))
    assert bm.num_evictions == 1
    assert bm.find_cached_prefix([*toks(4, 1000), 0]) == []
    assert len(bm.find_cached_prefix([*toks(4, 2000), 0])) == 1


def test_a_hit_refreshes_nothing_but_protects_the_block_while_referenced() -> None:
    bm = BlockManager(3, BS)
    fill(bm, "a", [*toks(4), 7])
    bm.free("a")
    hit = fill(bm, "b", [*toks(4), 8], num_new=1)
    assert hit == 4
    # The shared block is referenced again, so it is not free and cannot be evicted.
    assert bm.num_free_blocks == 1
    assert not bm.can_allocate(toks(9, 300), 9)


def test_can_append_and_append_grow_by_whole_blocks() -> None:
    bm = BlockManager(3, BS)
    fill(bm, "a", toks(4), num_new=4)
    assert len(bm.block_ids("a")) == 1
    assert bm.can_append("a", 5)
    bm.append("a", 5)
    assert len(bm.block_ids("a")) == 2
    bm.append("a", 8)  # still fits in two blocks
    assert len(bm.block_ids("a")) == 2
    assert bm.can_append("a", 12) and not bm.can_append("a", 13)
    with pytest.raises(RuntimeError):
        bm.append("a", 13)


def test_held_blocks_stay_referenced_until_released() -> None:
    bm = BlockManager(4, BS)
    fill(bm, "p", toks(6))
    held = bm.hold("p")
    assert len(held) == 2 and bm.num_held_blocks == 2
    assert bm.num_free_blocks == 2
    assert all(bm.ref_count(b) == 1 for b in held)
    assert bm.release_held("p")
    assert bm.num_held_blocks == 0 and bm.num_free_blocks == 4
    assert not bm.release_held("p")


def test_twin_blocks_computed_together_do_not_corrupt_the_cache() -> None:
    bm = BlockManager(6, BS)
    # Both admitted before either registers: no hits, two copies of the same content.
    bm.allocate("a", toks(5), 5)
    bm.allocate("b", toks(5), 5)
    bm.cache_full_blocks("a", toks(5), 5)
    bm.cache_full_blocks("b", toks(5), 5)
    first_a, first_b = bm.block_ids("a")[0], bm.block_ids("b")[0]
    bm.free("a")
    # The cached entry still points at a's block; b's twin is plain and reused first.
    assert bm.find_cached_prefix(toks(5)) == [first_a]
    bm.free("b")
    assert bm.num_cached_blocks == 1
    assert first_b not in bm.find_cached_prefix(toks(5))


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    fill(bm, "a", toks(9))
    bm.free("a")
    assert bm.find_cached_prefix(toks(9)) == []
    assert bm.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_unreferenced_blocks() -> None:
    bm = BlockManager(4, BS)
    fill(bm, "a", toks(9))
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert bm.find_cached_prefix(toks(9)) == []


def test_cached_hashes_digest_follows_the_cache_newest_last() -> None:
    bm = BlockManager(4, BS)
    a, b = toks(8), toks(8, 100)
    fill(bm, "a", a)
    assert bm.cached_hashes(16) == tuple(compute_block_hashes(a, BS))
    bm.free("a")  # still cached, so still in the digest
    fill(bm, "b", b)
    newest = tuple(compute_block_hashes(b, BS))
    assert bm.cached_hashes(16) == (*compute_block_hashes(a, BS), *newest)
    assert bm.cached_hashes(2) == newest  # capped to the most recently cached
    bm.free("b")
    fill(bm, "c", toks(12, 200))  # needs 3 of 4 blocks: evicts cached ones, oldest first
    digest = bm.cached_hashes(16)
    assert compute_block_hashes(a, BS)[1] not in digest
    assert digest[-3:] == tuple(compute_block_hashes(toks(12, 200), BS))
    assert bm.cached_hashes(16) is digest  # unchanged cache: the same tuple, not rebuilt
