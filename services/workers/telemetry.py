"""A worker's telemetry snapshot (DESIGN 3): what the router needs, built from engine stats."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from router.types import Role, RunningRequest, StepSample
from services.backends.protocol import Engine
from services.engine.messages import StepStats
from services.workers.messages import WorkerSnapshot

__all__ = ["LoopState", "build_snapshot"]


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
        num_images_encoded=stats.num_images_encoded,
        num_image_cache_hits=stats.num_image_cache_hits,
    )


def step_samples(steps: Sequence[StepStats]) -> tuple[StepSample, ...]:
    """The engine's recent steps for the router, each with its end time (the router's
    cost model reads a step once: the first snapshot whose step ends later than the last)."""
    return tuple(
        StepSample(
            s.duration_s, s.num_prefill_tokens, s.num_decode_seqs, s.total_context_tokens, s.end_s
        )
        for s in steps
    )
