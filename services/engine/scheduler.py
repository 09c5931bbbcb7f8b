"""Continuous batching with chunked prefill, counted in tokens rather than phases.

Every step each running request asks for ``num_tokens - num_computed_tokens`` new
tokens (a whole prompt, a chunk of it, or one decode token), capped by the step's
token budget (``max_num_batched_tokens``) and, where set, by the long-prefill threshold
(``long_prefill_token_threshold``, as vLLM's: while more than one request is in the
engine, none computes more tokens than that in one step, so a long prompt is prefilled
in chunks and a short one that arrives meanwhile runs in the next step, not after the
whole long prompt; a request alone has nobody to wait for it and takes the whole
budget). Running requests are served oldest first; when the pool cannot grow for one
of them, the NEWEST running request is preempted: its blocks are freed and it goes
back to the front of the waiting queue, to be recomputed (prompt + generated so far)
when it is admitted again. Waiting requests are admitted in arrival order while there
are sequence slots, budget, blocks and the ``AdmissionPolicy`` agrees; the first
refusal stops the scan (no overtaking). Adopted requests (KV filled from elsewhere)
already hold their blocks and are admitted before waiting ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from services.backends.protocol import AdmissionFeedback, AdmissionPolicy
from services.engine.kv_cache import BlockManager
from services.engine.messages import RunningRequestStats
from services.engine.request import Request, RequestStatus

__all__ = ["BlockAvailabilityAdmission", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


class BlockAvailabilityAdmission:
    """Admit when the blocks for the tokens still to compute (plus one) are free now."""

    def can_admit(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: Sequence[RunningRequestStats],
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        return -(-(num_prompt_tokens + 1) // block_size) <= num_free_blocks


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        admission: AdmissionPolicy | None = None,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.admission: AdmissionPolicy = admission or BlockAvailabilityAdmission()
        self.waiting: deque[Request] = deque()
        self.adopted: deque[Request] = deque()  # blocks filled, ready to run
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0

    # -- queues -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_adopted(self, request: Request) -> None:
        """A request whose blocks hold its first ``num_computed_tokens`` tokens' KV."""
        self.adopted.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.adopted or self.running)

    def running_stats(self) -> tuple[RunningRequestStats, ...]:
        return tuple(
            RunningRequestStats(
                request_id=r.request_id,
                num_tokens_held=r.num_computed_tokens,
                num_generated=r.num_output_tokens,
                max_tokens=_future_max_tokens(r),
            )
            for r in self.running
        )

    def prompt_tokens_to_compute(self) -> tuple[tuple[str, int], ...]:
        """Each prompt's request id and tokens still to compute before its first token,
        in the order the next step takes them: running prompts part-way through their
        chunks, then the waiting queue (what a request that arrives now waits behind)."""
        return tuple(
            (r.request_id, r.num_uncomputed_tokens)
            for queue in (self.running, self.waiting)
            for r in queue
            if r.num_computed_tokens < r.num_prompt_tokens
        )

    # -- the step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        cap = self._chunk_cap()
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_uncomputed_tokens, budget, cap)
            if not self._make_room(request, request.num_computed_tokens + num_new, preempted):
                break  # the request itself was the newest and got preempted
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        # A step that had to preempt admits nothing: the pool is already short.
        if not preempted:
            budget = self._admit_adopted(budget, cap, scheduled)
            self._admit_waiting(budget, cap, scheduled)
        return SchedulerOutput(scheduled, preempted)

    def _chunk_cap(self) -> int:
        """The most tokens one request computes this step (see the module)."""
        threshold = self.long_prefill_token_threshold
        if threshold and len(self.running) + len(self.adopted) + len(self.waiting) > 1:
            return threshold
        return self.max_num_batched_tokens

    def _make_room(self, request: Request, num_total_tokens: int, preempted: list[Request]) -> bool:
        """Grow the request's blocks, preempting the newest running requests as needed."""
        bm = self.block_manager
        if bm.blocks_needed(num_total_tokens) <= len(bm.block_ids(request.request_id)):
            return True  # most decode steps: the last block still has room
        while not bm.can_append(request.request_id, num_total_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        bm.append(request.request_id, num_total_tokens)
        return True

    def _admit_adopted(self, budget: int, cap: int, scheduled: list[ScheduledRequest]) -> int:
        bm = self.block_manager
        while self.adopted and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.adopted[0]
            num_new = min(request.num_uncomputed_tokens, budget, cap)
            if not bm.can_append(request.request_id, request.num_computed_tokens + num_new):
                break
            bm.append(request.request_id, request.num_computed_tokens + num_new)
            self.adopted.popleft()
            self._run(request, num_new, scheduled)
            budget -= num_new
        return budget

    def _admit_waiting(self, budget: int, cap: int, scheduled: list[ScheduledRequest]) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            request = self.waiting[0]
            # Logits for every prompt position wanted: nothing read from the prefix cache.
            token_ids = () if request.computes_prompt_logprobs else request.hash_token_ids
            num_hit_tokens = len(bm.find_cached_prefix(token_ids)) * bm.block_size
            num_to_compute = request.num_tokens - num_hit_tokens
            num_new = min(num_to_compute, budget, cap)
            # The policy sees the tokens that need new KV (prompt minus prefix hits).
            admitted = self.admission.can_admit(
                num_to_compute,
                _future_max_tokens(request),
                self.running_stats(),
                bm.num_free_blocks,
                bm.num_total_blocks,
                bm.block_size,
            )
            if not admitted or not bm.can_allocate(token_ids, num_new):
                break
            num_hit_tokens = bm.allocate(request.request_id, token_ids, num_new)
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(num_hit_tokens, request.num_prompt_tokens)
            self.num_prefix_hit_tokens += num_hit_tokens
            self._run(request, num_new, scheduled)
            budget -= num_new

    def _run(self, request: Request, num_new: int, scheduled: list[ScheduledRequest]) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(ScheduledRequest(request, num_new))

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        if isinstance(self.admission, AdmissionFeedback):
            self.admission.record_exhaustion()
        self.waiting.appendleft(request)

    # -- endings ----------------------------------------------------------------
    def finish(self, request: Request, *, hold: bool = False) -> list[int]:
        """Remove a finished request; return its block ids if they are held for a puller."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        if hold:
            return self.block_manager.hold(request.request_id)
        self.block_manager.free(request.request_id)
        return []

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks (held ones included)."""
        everyone = (*self.waiting, *self.adopted, *self.running)
        found = next((r for r in everyone if r.request_id == request_id), None)
        if found is not None:
            for queue in (self.waiting, self.adopted, self.running):
                if found in queue:
                    queue.remove(found)
            found.status = RequestStatus.FINISHED
        self.block_manager.free(request_id)
        self.block_manager.release_held(request_id)
        return found


def _future_max_tokens(request: Request) -> int:
    """The most tokens a request may still grow to: a prefill-only one stops at its first."""
    return 1 if request.prefill_only else request.sampling.max_tokens
