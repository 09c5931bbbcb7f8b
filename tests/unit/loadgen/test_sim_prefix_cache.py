"""The simulated workers' prefix caches: leading blocks only, per worker, least
recently used out first when the worker's KV memory is full."""

from __future__ import annotations

from loadgen.sim.prefix_cache import PrefixCaches
from loadgen.sim.request import SimRequest


def _request(hash_ids: tuple[int, ...], block_tokens: int = 100) -> SimRequest:
    n = len(hash_ids) * block_tokens
    return SimRequest("r", 0.0, n, 10, 10, hash_ids)


def test_only_the_leading_cached_blocks_count_and_only_where_they_were_computed() -> None:
    caches = PrefixCaches(["a", "b"])
    caches.insert("a", _request((1, 2, 3)), capacity_tokens=10_000)
    assert caches.cached_tokens("a", _request((1, 2, 9, 3))) == 200  # stops at the miss
    assert caches.cached_tokens("a", _request((9, 1, 2))) == 0
    assert caches.cached_tokens("b", _request((1, 2, 3))) == 0
    assert caches.digest("a") == (1, 2, 3) and caches.digest("b") == ()


def test_a_full_cache_drops_the_least_recently_used_blocks() -> None:
    caches = PrefixCaches(["a"])
    caches.insert("a", _request((1, 2)), capacity_tokens=300)  # room for 3 blocks
    caches.insert("a", _request((3,)), capacity_tokens=300)
    caches.insert("a", _request((1,)), capacity_tokens=300)  # 1 used again: 2 is oldest
    caches.insert("a", _request((4,)), capacity_tokens=300)
    assert caches.digest("a") == (3, 1, 4)
    assert caches.cached_tokens("a", _request((2,))) == 0
    assert caches.cached_tokens("a", _request((3, 1, 4))) == 300
