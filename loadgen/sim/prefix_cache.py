"""Each simulated worker's prefix cache: the prompt blocks its engine keeps, by block
hash, least recently used out first, as many as its KV memory holds. A request's
prompt is ``len(hash_ids)`` equal blocks; what a worker has cached of its leading
blocks is not prefilled again there, and the worker reports what it keeps as its
prefix digest (``WorkerSnapshot.prefix_digest``), which the router matches prompts
against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from loadgen.sim.request import SimRequest

__all__ = ["PrefixCaches"]


class PrefixCaches:
    def __init__(self, worker_ids: Iterable[str]) -> None:
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._digests: dict[str, tuple[int, ...]] = {}
        for worker_id in worker_ids:
            self._blocks[worker_id] = OrderedDict()
            self._digests[worker_id] = ()

    def cached_tokens(self, worker_id: str, req: SimRequest) -> int:
        """The tokens of ``req``'s leading blocks that ``worker_id`` has cached."""
        blocks = self._blocks[worker_id]
        hits = 0
        for h in req.hash_ids:
            if h not in blocks:
                break
            hits += 1
        return hits * _block_tokens(req)

    def insert(self, worker_id: str, req: SimRequest, capacity_tokens: int) -> None:
        """``req``'s prompt was computed on ``worker_id``: its blocks are the most
        recently used there; the least recently used go past ``capacity_tokens``."""
        blocks = self._blocks[worker_id]
        for h in req.hash_ids:
            blocks[h] = None
            blocks.move_to_end(h)
        limit = max(1, capacity_tokens // max(1, _block_tokens(req)))
        while len(blocks) > limit:
            blocks.popitem(last=False)
        self._digests[worker_id] = tuple(blocks)

    def digest(self, worker_id: str) -> tuple[int, ...]:
        """The block hashes ``worker_id`` keeps, least recently used first."""
        return self._digests[worker_id]


def _block_tokens(req: SimRequest) -> int:
    return req.input_len // len(req.hash_ids) if req.hash_ids else 0
