"""Which workers hold which leading prefix blocks: block hash -> worker positions.

Kept incrementally from each worker's ``prefix_digest`` so that matching a
request costs in proportion to the workers that hold its first block, not to
the size of the cluster.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}
        self._digests: list[frozenset[int]] = []

    def reset(self, digests: Sequence[frozenset[int]]) -> None:
        self._holders = {}
        self._digests = [frozenset()] * len(digests)
        for index, digest in enumerate(digests):
            self.update(index, digest)

    def update(self, index: int, digest: frozenset[int]) -> None:
        old = self._digests[index]
        if digest is old or digest == old:
            return
        for block_hash in old - digest:
            holders = self._holders[block_hash]
            holders.discard(index)
            if not holders:
                del self._holders[block_hash]
        for block_hash in digest - old:
            self._holders.setdefault(block_hash, set()).add(index)
        self._digests[index] = digest

    def matched_blocks(self, prefix_hashes: Sequence[int]) -> dict[int, int]:
        """For each worker holding at least the first block: how many leading blocks."""
        matched: dict[int, int] = {}
        if not prefix_hashes:
            return matched
        alive = set(self._holders.get(prefix_hashes[0], ()))
        depth = 1
        for block_hash in prefix_hashes[1:]:
            if not alive:
                break
            holders = self._holders.get(block_hash, set())
            for index in alive - holders:
                matched[index] = depth
            alive &= holders
            depth += 1
        for index in alive:
            matched[index] = depth
        return matched
