"""One simulated worker: counts tokens, not phases.

Each step the worker (1) admits decode arrivals whose KV has landed, (2) fills
the step's token budget with prefill chunks from ONE first-come-first-served
queue, as the engine's scheduler does (Sarathi-style: running decodes take one
token each first; a preempted request goes back to the front), (3) lasts as long
as the profile says. A PREFILL
worker has no running decodes and a large budget; a DECODE worker only
prefills to recompute a preempted request; a MIXED worker does both (the
aggregated baseline with chunked prefill).

To stay fast at hundreds of workers, a stretch of pure decode steps with no
prefill is one *segment* — one event up to the next finish or memory limit —
whose step times are summed in closed form (step k lasts ``base + k·inc``
because context grows by B tokens a step). Something arriving mid-segment cuts
it at the next step boundary, as a real engine admits work between steps.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable
from itertools import chain
from typing import Protocol

import numpy as np

from loadgen.sim.profile import Profile
from loadgen.sim.request import SimRequest
from router.types import Role, StepSample

__all__ = ["Admission", "SimWorker"]

_ROW_FIELDS = operator.attrgetter("held", "generated", "max_tokens")


class Admission(Protocol):
    """The engine's decode admission rule (``router.estimator.PastFutureAdmission``)."""

    def can_admit_arrays(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: np.ndarray,
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        """``can_admit`` with the running requests as rows (held, generated, max_tokens)."""
        ...

    def observe_finished(self, output_len: int) -> None: ...

    def record_exhaustion(self) -> None: ...


# Callbacks into the cluster: (worker, request, now_s).
Hook = Callable[["SimWorker", SimRequest, float], None]
# (worker, now_s, sample): one mean step of what just ran, for telemetry and ITL.
StepHook = Callable[["SimWorker", float, StepSample, int], None]


class SimWorker:
    """Worker state plus its step logic; the cluster owns the clock and the event heap."""

    def __init__(
        self,
        worker_id: str,
        role: Role,
        profile: Profile,
        budget_tokens: int,
        schedule: Callable[[float, SimWorker, int], None],
        on_prefilled: Hook,
        on_finished: Hook,
        on_admitted: Hook,
        on_step: StepHook,
        dirty_list: list[SimWorker],
        admission: Admission | None = None,
        long_prefill_tokens: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.role = role
        self.profile = profile
        self.budget_tokens = budget_tokens
        # The engine's ``long_prefill_token_threshold`` (0: none): see ``_take_chunks``.
        self.long_prefill_tokens = long_prefill_tokens
        self.capacity_tokens = profile.num_kv_blocks * profile.block_size
        self._schedule = schedule
        self._on_prefilled = on_prefilled
        self._on_finished = on_finished
        self._on_admitted = on_admitted
        self._on_step = on_step
        self.admission = admission  # None: admit whenever the KV fits now (vLLM-style)
        self.queue: deque[SimRequest] = deque()  # prefill work, FCFS
        self.waiting: deque[SimRequest] = deque()  # KV landed, not yet admitted
        self.running: list[SimRequest] = []
        self.running_version = 0  # bumps whenever ``running`` or a request in it moved
        self.num_inbound = 0  # planned to decode here, not admitted yet
        self.draining = False
        self.used_tokens = 0
        self.version = 0  # bumps invalidate a scheduled step end
        self.busy = False
        self.dirty = True  # view must be rebuilt
        self._dirty_list = dirty_list  # shared: the cluster rebuilds only these views
        dirty_list.append(self)
        # The step in flight.
        self._t0 = 0.0
        self._base = 0.0
        self._inc = 0.0
        self._steps = 0
        self._chunks: list[tuple[SimRequest, int]] = []
        # Its encodes (encode colocated: a prompt's images are encoded in the step that
        # starts its prefill, as vLLM does): each request's image tokens.
        self._encodes: list[int] = []
        self._end_s = 0.0
        self.num_preempted = 0

    def mark_dirty(self) -> None:
        if not self.dirty:
            self.dirty = True
            self._dirty_list.append(self)

    # ---- arrivals -------------------------------------------------------
    def is_idle(self) -> bool:
        """Nothing queued, running, landing or on its way here (a drain is over)."""
        return not (self.busy or self.queue or self.waiting or self.running or self.num_inbound)

    def prompt_tokens_to_compute(self) -> tuple[int, ...]:
        """Each prompt's tokens not yet computed as at the start of the step in flight,
        in the order the engine takes them: the prompts whose last chunk is in the step,
        then the queue (a prompt cut by the budget or the threshold stays there). A
        worker's engine reports this between two steps (``waiting_prompt_lens``), where
        the step about to run is still to come; reported mid-step without the chunks in
        flight, the queue looked a step shorter than a request arriving then waits for
        (a step of 8192 tokens is 0.26 s on llama3-8b-h100)."""
        in_flight = [n for req, n in self._chunks if n == req.prefill_left]
        return tuple(in_flight + [r.prefill_left for r in self.queue])

    def image_tokens_to_encode(self) -> tuple[int, ...]:
        """Each prompt's image tokens still to encode here (encode colocated), as at the
        start of the step in flight (``prompt_tokens_to_compute``): those in the step,
        then the queue's."""
        queued = [r.num_image_tokens for r in self.queue if r.encode_s]
        return tuple(self._encodes + queued) if self.busy else tuple(queued)

    def enqueue_prefill(self, req: SimRequest, now_s: float) -> None:
        self.queue.append(req)
        self.mark_dirty()
        self._poke(now_s)

    def enqueue_decode(self, req: SimRequest, now_s: float) -> None:
        self.waiting.append(req)
        self.mark_dirty()
        self._poke(now_s)

    def _poke(self, now_s: float) -> None:
        """New work: start now if idle, else cut a decode segment at its next step boundary."""
        if not self.busy:
            self._start_step(now_s)
            return
        if self._steps <= 1:
            return
        done = self._steps_done_by(now_s - self._t0)
        if done + 1 < self._steps:
            self._steps = done + 1
            self._end_s = self._t0 + self._elapsed(self._steps)
            self.version += 1
            self._schedule(self._end_s, self, self.version)

    # ---- one step -------------------------------------------------------
    def _start_step(self, now_s: float) -> None:
        self._admit(now_s)
        chunks = self._take_chunks()
        batch = len(self.running)
        if not chunks and not batch:
            self.busy = False
            return
        context = self.used_tokens
        prof = self.profile
        self._t0 = now_s
        self._chunks = chunks
        self._encodes = []
        if chunks:
            dur = prof.prefill.a if not batch else max(prof.prefill.a, prof.decode.a)
            for req, n in chunks:
                done = req.prefill_total - req.prefill_left
                dur += prof.prefill.b * n + prof.prefill.c * ((done + n) ** 2 - done * done)
                if req.encode_s:  # encode colocated: the images are encoded here first
                    dur += req.encode_s
                    req.encode_s = 0.0
                    self._encodes.append(req.num_image_tokens)
            if batch:
                dur += prof.decode.b * batch + prof.decode.c * context
            self._base, self._inc, self._steps = dur, 0.0, 1
        else:
            self._base = prof.decode.a + prof.decode.b * batch + prof.decode.c * context
            self._inc = prof.decode.c * batch
            self._steps = self._segment_steps(batch)
        self._end_s = now_s + self._elapsed(self._steps)
        self.busy = True
        self.version += 1
        self._schedule(self._end_s, self, self.version)

    def _segment_steps(self, batch: int) -> int:
        to_finish = min(r.output_len - r.generated for r in self.running)
        room = (self.capacity_tokens - self.used_tokens) // batch
        return max(1, min(to_finish, room))

    def end_step(self, now_s: float) -> None:
        """The scheduled step (or segment) ended at ``now_s``."""
        steps, batch = self._steps, len(self.running)
        if batch:
            self.running_version += 1
            mean_step_s = self._elapsed(steps) / steps
            self.used_tokens += batch * steps
            finished: list[SimRequest] = []
            for r in self.running:
                r.generated += steps
                r.held += steps
                if r.generated >= r.output_len:
                    finished.append(r)
            if finished:
                for r in finished:
                    if self.admission is not None:
                        self.admission.observe_finished(r.output_len)
                    self.running.remove(r)
                    self.used_tokens -= r.held
                    r.finish_s = now_s
                    self._on_finished(self, r, now_s)
        else:
            mean_step_s = 0.0
        num_prefill = 0
        for req, n in self._chunks:
            req.prefill_left -= n
            num_prefill += n
            if req.prefill_left == 0:
                self._prefilled(req, now_s)
        self._chunks = []
        # Context at the middle of a segment: its steps' mean duration belongs there.
        context = self.used_tokens - batch * steps // 2 if not num_prefill else self.used_tokens
        sample = StepSample(
            duration_s=mean_step_s if not num_prefill else now_s - self._t0,
            num_prefill_tokens=num_prefill,
            num_decode_seqs=batch,
            total_context_tokens=context,
            end_s=now_s,
            num_encodes=len(self._encodes),
            num_encoded_image_tokens=sum(self._encodes),
        )
        self._on_step(self, now_s, sample, steps)
        self.mark_dirty()
        self._preempt_if_full()
        self._start_step(now_s)

    def _prefilled(self, req: SimRequest, now_s: float) -> None:
        if req.resume:  # recomputed after preemption: back into the batch
            req.resume = False
            self._join(req)
            return
        req.generated = 1
        req.ttft_s = now_s
        if req.output_len <= 1:
            req.finish_s = now_s
            self._on_finished(self, req, now_s)
            return
        # Hand over: colocated joins this worker's batch, else the cluster moves the KV.
        self._on_prefilled(self, req, now_s)

    # ---- admission and memory ----------------------------------------------
    def _admit(self, now_s: float) -> None:
        while self.waiting and len(self.running) < self.profile.max_num_seqs:
            req = self.waiting[0]
            need = req.input_len + req.generated
            if self.used_tokens + need + len(self.running) + 1 > self.capacity_tokens:
                break
            if self.running and not self._estimator_admits(req, need):
                break  # an empty worker always admits what fits, or nothing would move
            self.waiting.popleft()
            self.num_inbound -= 1
            req.held = need
            self._join(req)
            self._on_admitted(self, req, now_s)

    def _estimator_admits(self, req: SimRequest, need: int) -> bool:
        if self.admission is None:
            return True
        bs = self.profile.block_size
        n = len(self.running)
        flat = chain.from_iterable(map(_ROW_FIELDS, self.running))
        running = np.fromiter(flat, np.float64, 3 * n).reshape(n, 3)
        return self.admission.can_admit_arrays(
            need,
            req.max_tokens,
            running,
            (self.capacity_tokens - self.used_tokens) // bs,
            self.profile.num_kv_blocks,
            bs,
        )

    def join_colocated(self, req: SimRequest) -> None:
        req.held = req.input_len + req.generated
        self._join(req)

    def _join(self, req: SimRequest) -> None:
        self.running.append(req)
        self.running_version += 1
        self.used_tokens += req.held
        self.mark_dirty()

    def _preempt_if_full(self) -> None:
        # Recompute-style preemption of the newest, as vLLM does.
        while self.running and self.used_tokens + len(self.running) > self.capacity_tokens:
            victim = self.running.pop()
            self.running_version += 1
            self.used_tokens -= victim.held
            victim.prefill_left = victim.prefill_total = victim.held
            victim.held = 0
            victim.resume = True
            self.queue.appendleft(victim)
            self.num_preempted += 1
            if self.admission is not None:
                self.admission.record_exhaustion()

    def _take_chunks(self) -> list[tuple[SimRequest, int]]:
        """The queue, from its head, fills what the running decodes leave of the
        budget, as the engine's scheduler does: with a long-prefill threshold and more
        than one request here, no request takes more than the threshold in a step.
        A request whose last chunk is taken leaves the queue (the engine runs it); one
        cut by the budget or the threshold keeps its place, its tokens still waiting."""
        budget = self.budget_tokens - len(self.running)
        queue = self.queue
        cap = self.long_prefill_tokens
        if not cap or len(queue) + len(self.running) <= 1:
            cap = budget
        chunks: list[tuple[SimRequest, int]] = []
        for req in queue:
            if budget <= 0:
                break
            n = min(req.prefill_left, budget, cap)
            chunks.append((req, n))
            budget -= n
        cut = [req for req, n in chunks if n < req.prefill_left]
        for _ in chunks:
            queue.popleft()
        queue.extendleft(reversed(cut))
        return chunks

    # ---- closed-form segment timing ----------------------------------------
    def _elapsed(self, steps: int) -> float:
        return steps * self._base + self._inc * steps * (steps - 1) / 2

    def _steps_done_by(self, elapsed_s: float) -> int:
        if elapsed_s <= 0:
            return 0
        if self._inc <= 0:
            k = int(elapsed_s / self._base)
        else:
            half = self._inc / 2
            b = self._base - half
            k = int((-b + math.sqrt(b * b + 4 * half * elapsed_s)) / (2 * half))
        while k > 0 and self._elapsed(k) > elapsed_s:
            k -= 1
        return min(k, self._steps)

    def progress_at(self, now_s: float) -> int:
        """Decode steps completed in the current segment by ``now_s`` (for telemetry)."""
        if not self.busy or self._chunks:
            return 0
        return self._steps_done_by(now_s - self._t0)
