"""The gateway's picture of the cluster: last telemetry per worker plus its own reservations.

Telemetry lags by up to one interval, so a request the gateway has just placed
is not in it yet. Each placement therefore reserves (blocks, a running slot,
queued prefill tokens) on the workers it chose until that worker has
acknowledged the request (its first event), so that two requests in the same
millisecond do not both take the last free slot.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass

from router.types import ClusterView, LengthClass, RunningRequest, WorkerView
from services.workers.messages import WorkerSnapshot

__all__ = ["ClusterState", "Reservation"]

_DEFAULT_LENGTH_THRESHOLD_TOKENS = 512
_OUTPUT_HISTORY = 256


@dataclass(frozen=True, slots=True)
class Reservation:
    token: int
    worker_id: str
    num_prompt_tokens: int
    max_tokens: int
    prefill: bool  # counts as queued prefill work on that worker


class ClusterState:
    def __init__(self, length_threshold_tokens: int | None = None) -> None:
        self._threshold = length_threshold_tokens or _DEFAULT_LENGTH_THRESHOLD_TOKENS
        self._snapshots: dict[str, WorkerSnapshot] = {}
        self._dead: set[str] = set()
        self._reservations: dict[int, Reservation] = {}
        self._tokens = itertools.count()
        self._output_lens: deque[int] = deque(maxlen=_OUTPUT_HISTORY)
        # worker -> (digest as sent, as a set): rebuilt only when a worker's digest changed,
        # and the same set object otherwise (the router compares digests by identity first).
        self._digests: dict[str, tuple[tuple[int, ...], frozenset[int]]] = {}

    # -- telemetry and health ------------------------------------------------------
    def update(self, snapshot: WorkerSnapshot) -> None:
        if snapshot.worker_id in self._dead:
            return
        previous = self._snapshots.get(snapshot.worker_id)
        if previous is not None and snapshot.seq <= previous.seq:
            return  # out of order
        self._snapshots[snapshot.worker_id] = snapshot
        known = self._digests.get(snapshot.worker_id)
        if known is None or known[0] != snapshot.prefix_digest:
            digest = snapshot.prefix_digest
            self._digests[snapshot.worker_id] = (digest, frozenset(digest))

    def record_output_len(self, num_tokens: int) -> None:
        self._output_lens.append(num_tokens)

    def mark_dead(self, worker_id: str) -> None:
        self._dead.add(worker_id)
        self._snapshots.pop(worker_id, None)
        self._digests.pop(worker_id, None)
        for token, r in list(self._reservations.items()):
            if r.worker_id == worker_id:
                del self._reservations[token]

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self._snapshots

    def snapshots(self) -> dict[str, WorkerSnapshot]:
        return dict(self._snapshots)

    def block_size(self) -> int | None:
        """The KV block size prompts are hashed by for prefix matching (the smallest reported)."""
        sizes = [s.block_size for s in self._snapshots.values()]
        return min(sizes) if sizes else None

    def max_model_len(self) -> int | None:
        lens = [s.max_model_len for s in self._snapshots.values()]
        return min(lens) if lens else None

    # -- reservations -------------------------------------------------------------------
    def reserve(
        self, worker_id: str, num_prompt_tokens: int, max_tokens: int, *, prefill: bool
    ) -> Reservation:
        r = Reservation(next(self._tokens), worker_id, num_prompt_tokens, max_tokens, prefill)
        self._reservations[r.token] = r
        return r

    def release(self, reservation: Reservation | None) -> None:
        if reservation is not None:
            self._reservations.pop(reservation.token, None)

    def num_reservations(self) -> int:
        return len(self._reservations)

    # -- the router's view ------------------------------------------------------------
    def view(self) -> ClusterView:
        workers = tuple(self._worker_view(s) for s in self._snapshots.values())
        return ClusterView(workers, tuple(self._output_lens))

    def length_class(self, num_tokens: int) -> LengthClass:
        return LengthClass.SHORT if num_tokens < self._threshold else LengthClass.LONG

    def _worker_view(self, s: WorkerSnapshot) -> WorkerView:
        queued_tokens = {LengthClass.SHORT: 0, LengthClass.LONG: 0}
        queued_requests = {LengthClass.SHORT: 0, LengthClass.LONG: 0}
        for n in s.waiting_prompt_lens:
            queued_tokens[self.length_class(n)] += n
            queued_requests[self.length_class(n)] += 1
        running = list(s.running)
        num_free_blocks = s.num_free_blocks
        for r in self._reservations.values():
            if r.worker_id != s.worker_id:
                continue
            num_free_blocks -= math.ceil((r.num_prompt_tokens + 1) / s.block_size)
            running.append(RunningRequest(r.num_prompt_tokens, 0, r.max_tokens))
            if r.prefill:
                queued_tokens[self.length_class(r.num_prompt_tokens)] += r.num_prompt_tokens
                queued_requests[self.length_class(r.num_prompt_tokens)] += 1
        return WorkerView(
            worker_id=s.worker_id,
            role=s.role,
            num_total_blocks=s.num_total_blocks,
            num_free_blocks=max(0, num_free_blocks),
            block_size=s.block_size,
            queued_tokens=queued_tokens,
            queued_requests=queued_requests,
            running=tuple(running),
            recent_steps=s.recent_steps,
            kv_bytes_per_token=s.kv_bytes_per_token,
            max_num_seqs=s.max_num_seqs,
            draining=s.draining,
            prefix_digest=self._digests[s.worker_id][1],
        )
