"""What a simulated worker reports to the router: a ``WorkerSnapshot``'s fields that
``router.Router.update`` reads (``router.front_door.WorkerReport``), nothing more.

The simulator reports a worker whenever its state changed and before the next
decision (the live gateway sees telemetry up to 100 ms old, and covers the gap with
the same reservations the simulator uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from router.types import Role, RunningRequest, StepSample

__all__ = ["SimReport"]


@dataclass(frozen=True, slots=True)
class SimReport:
    worker_id: str
    role: Role
    draining: bool
    seq: int
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    running: tuple[RunningRequest, ...]
    waiting_prompt_lens: tuple[int, ...]
    recent_steps: tuple[StepSample, ...]
    kv_bytes_per_token: int
    max_num_seqs: int
    prefix_digest: tuple[int, ...]
    prefill_budget_tokens: int
