"""A worker's telemetry snapshot (DESIGN 3): what the router needs, built from engine stats,
and when the engine loop publishes one (``SnapshotPublisher``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.types import Role, RunningRequest, StepSample
from services.backends.protocol import Engine
from services.engine.messages import StepStats
from services.workers.messages import WorkerSnapshot

__all__ = ["LoopState", "SnapshotPublisher", "build_snapshot"]

# A snapshot after an admission or a finish goes out this much later, so that its
# serialisation does not compete with the token that caused it; and no more often
# than every _MIN_PUBLISH_GAP_S under load.
_PUBLISH_DELAY_S = 0.002
_MIN_PUBLISH_GAP_S = 0.005


@dataclass(frozen=True, slots=True)
class LoopState:
    """What the engine loop knows beyond the engine's own stats."""

    worker_id: str
    role: Role
    draining: bool
    seq: int
    num_pending_pulls: int
    num_finished_requests: int
    max_num_seqs: int


def build_snapshot(engine: Engine, loop: LoopState) -> WorkerSnapshot:
    """Called on the engine loop thread (``engine.stats()`` is not thread-safe)."""
    stats = engine.stats()
    layout = engine.kv_layout
    return WorkerSnapshot(
        worker_id=loop.worker_id,
        role=loop.role,
        draining=loop.draining,
        seq=loop.seq,
        time_s=time.monotonic(),
        block_size=stats.block_size,
        num_total_blocks=stats.num_total_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_held_blocks=stats.num_held_blocks,
        running=tuple(
            RunningRequest(r.num_tokens_held, r.num_generated, r.max_tokens) for r in stats.running
        ),
        waiting_prompt_lens=stats.waiting_prompt_lens,
        recent_steps=step_samples(stats.recent_steps),
        recent_output_lens=stats.recent_output_lens,
        num_preemptions=stats.num_preemptions,
        num_pending_pulls=loop.num_pending_pulls,
        num_finished_requests=loop.num_finished_requests,
        kv_bytes_per_token=layout.block_bytes // layout.block_size,
        max_num_seqs=loop.max_num_seqs,
        max_model_len=engine.model_info.max_model_len,
        prefix_digest=stats.cached_block_hashes,
        prefill_budget_tokens=stats.max_num_batched_tokens,
        long_prefill_tokens=stats.long_prefill_token_threshold,
        num_images_encoded=stats.num_images_encoded,
        num_image_cache_hits=stats.num_image_cache_hits,
        waiting_image_tokens=stats.waiting_image_tokens,
        waiting_request_ids=stats.waiting_request_ids,
    )


def step_samples(steps: Sequence[StepStats]) -> tuple[StepSample, ...]:
    """The engine's recent steps for the router, each with its end time (the router's
    cost model reads a step once: the first snapshot whose step ends later than the last)."""
    return tuple(
        StepSample(
            s.duration_s,
            s.num_prefill_tokens,
            s.num_decode_seqs,
            s.total_context_tokens,
            s.end_s,
            s.num_encodes,
            s.num_encoded_image_tokens,
        )
        for s in steps
    )


class SnapshotPublisher:
    """The engine loop's snapshots: each built on its thread, published on a schedule.

    A change the router should see soon (an admission, a finish, a role change) is a
    ``touch``: a snapshot follows ``_PUBLISH_DELAY_S`` later, at most every
    ``_MIN_PUBLISH_GAP_S``; without one, a snapshot every ``interval_s``. The loop calls
    ``publish_if_due`` once an iteration and sleeps no later than ``next_publish_s``.
    """

    def __init__(
        self,
        worker_id: str,
        engine: Engine,
        *,
        on_snapshot: Callable[[WorkerSnapshot], None],
        role_state: Callable[[], tuple[Role, bool]],
        num_pending_pulls: Callable[[], int],
        interval_s: float,
        max_num_seqs: int,
    ) -> None:
        self._worker_id = worker_id
        self._engine = engine
        self._on_snapshot = on_snapshot
        self._role_state = role_state
        self._num_pending_pulls = num_pending_pulls
        self._interval_s = interval_s
        self._max_num_seqs = max_num_seqs
        self._seq = 0
        self._num_finished = 0
        self._last_publish_s = 0.0
        self._dirty = True
        self._dirty_since_s = 0.0

    def touch(self) -> None:
        """Something the router should see changed: publish soon."""
        if not self._dirty:
            self._dirty = True
            self._dirty_since_s = time.monotonic()

    def count_finished(self) -> None:
        """A request finished (and the router should see it soon)."""
        self._num_finished += 1
        self.touch()

    def next_publish_s(self) -> float:
        periodic_s = self._last_publish_s + self._interval_s
        if not self._dirty:
            return periodic_s
        soon_s = max(
            self._dirty_since_s + _PUBLISH_DELAY_S, self._last_publish_s + _MIN_PUBLISH_GAP_S
        )
        return min(soon_s, periodic_s)

    def publish_if_due(self) -> None:
        now = time.monotonic()
        if now >= self.next_publish_s():
            self._on_snapshot(self.take())
            self._dirty = False
            self._last_publish_s = now

    def take(self) -> WorkerSnapshot:
        """A snapshot now (each has the next ``seq``)."""
        role, draining = self._role_state()
        self._seq += 1
        return build_snapshot(
            self._engine,
            LoopState(
                worker_id=self._worker_id,
                role=role,
                draining=draining,
                seq=self._seq,
                num_pending_pulls=self._num_pending_pulls(),
                num_finished_requests=self._num_finished,
                max_num_seqs=self._max_num_seqs,
            ),
        )
