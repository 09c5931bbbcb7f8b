"""What a simulated worker reports to the router: a ``WorkerSnapshot``'s fields that
``router.Router.update`` reads (``router.types.WorkerReport``), nothing more.

The simulator reports a worker whenever its state changed and before the next
decision (the live gateway sees telemetry up to 100 ms old, and covers the gap with
the same reservations the simulator uses). A report that says nothing the last one
the router took did not (``same_state``: a decode worker whose KV landed before its
next step) is not sent: the router would rebuild that worker's row to the same values.
A running set that did not move is reported as the same tuple (``RunningSets``), so
the router's per-running-set caches keep their entry. ``Reports`` builds the reports
and keeps what only they need: each worker's sequence number, its recent step
samples, its running set as last reported and the last report the router took.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from loadgen.sim.prefix_cache import PrefixCaches
from loadgen.sim.profile import Profile
from loadgen.sim.worker import SimWorker
from router.types import Role, RunningRequest, StepSample

__all__ = ["Reports", "RunningSets", "SimReport", "running_request", "same_state"]

_new_running = RunningRequest.__new__
_set_held = RunningRequest.num_tokens_held.__set__  # type: ignore[attr-defined,misc]
_set_generated = RunningRequest.num_generated.__set__  # type: ignore[attr-defined,misc]
_set_max_tokens = RunningRequest.max_tokens.__set__  # type: ignore[attr-defined,misc]


def running_request(held: int, generated: int, max_tokens: int) -> RunningRequest:
    """``RunningRequest(held, generated, max_tokens)`` through its slots: the frozen
    dataclass ``__init__`` costs more than the rest of a report, at 256 per worker."""
    r = _new_running(RunningRequest)
    _set_held(r, held)
    _set_generated(r, generated)
    _set_max_tokens(r, max_tokens)
    return r


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
    long_prefill_tokens: int
    waiting_image_tokens: tuple[int, ...] = ()
    # The simulator releases a prompt's reservation on its prefill worker as the prompt
    # joins that worker's queue (``SimCluster._place``), so it names none here.
    waiting_request_ids: tuple[str, ...] = ()


class RunningSets:
    """Each worker's running set as reported: rebuilt only when it moved (a step,
    an admission, a preemption: ``SimWorker.running_version``) or the segment in
    flight advanced (``k`` steps into it), else the tuple reported last time."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int, tuple[RunningRequest, ...]]] = {}

    def at(self, w: SimWorker, k: int) -> tuple[RunningRequest, ...]:
        last = self._last.get(w.worker_id)
        if last is not None and last[0] == w.running_version and last[1] == k:
            return last[2]
        running = tuple(
            [running_request(r.held + k, r.generated + k, r.max_tokens) for r in w.running]
        )
        self._last[w.worker_id] = (w.running_version, k, running)
        return running


def same_state(last: SimReport, now: SimReport) -> bool:
    """``now`` says nothing ``last`` did not (its running set the same object)."""
    return (
        now.running is last.running
        and now.num_free_blocks == last.num_free_blocks
        and now.waiting_prompt_lens == last.waiting_prompt_lens
        and now.waiting_image_tokens == last.waiting_image_tokens
        and now.recent_steps == last.recent_steps
        and now.prefix_digest == last.prefix_digest
        and now.role is last.role
        and now.draining == last.draining
        and now.prefill_budget_tokens == last.prefill_budget_tokens
        and now.long_prefill_tokens == last.long_prefill_tokens
        and now.num_total_blocks == last.num_total_blocks
        and now.max_num_seqs == last.max_num_seqs
        and now.block_size == last.block_size
        and now.kv_bytes_per_token == last.kv_bytes_per_token
    )


class Reports:
    """Each worker's reports: built from its state now, and passed on only when they
    say something new. The prefix caches are the cluster's (placement reads them too);
    a report only reads their digest."""

    def __init__(self, profile: Profile, worker_ids: Iterable[str], prefixes: PrefixCaches) -> None:
        self.profile = profile
        self._prefixes = prefixes
        worker_ids = list(worker_ids)
        self._seq = {worker_id: 0 for worker_id in worker_ids}
        self._steps: dict[str, deque[StepSample]] = {
            worker_id: deque(maxlen=4) for worker_id in worker_ids
        }
        # Per worker, the running set it last reported: (running_version, steps into the
        # segment, the tuple). Reported again unchanged, it is the same tuple.
        self._running_sets = RunningSets()
        self._sent: dict[str, SimReport] = {}  # per worker, the last report the router took

    def record_step(self, worker_id: str, sample: StepSample) -> None:
        self._steps[worker_id].append(sample)

    def news(self, w: SimWorker, now_s: float) -> SimReport | None:
        """The worker's report now, taken as sent; None if it says nothing the last
        one sent did not (``same_state``)."""
        report = self.build(w, now_s)
        last = self._sent.get(w.worker_id)
        if last is not None and same_state(last, report):
            return None
        self._sent[w.worker_id] = report
        return report

    def build(self, w: SimWorker, now_s: float) -> SimReport:
        """What the worker's engine would report now (``WorkerSnapshot``'s fields)."""
        k = w.progress_at(now_s)
        running = self._running_sets.at(w, k)
        used_tokens = w.used_tokens + k * len(w.running)
        prof = self.profile
        seq = self._seq[w.worker_id] = self._seq[w.worker_id] + 1
        return SimReport(
            worker_id=w.worker_id,
            role=w.role,
            draining=w.draining,
            seq=seq,
            block_size=prof.block_size,
            num_total_blocks=w.profile.num_kv_blocks,
            num_free_blocks=max(0, (w.capacity_tokens - used_tokens) // prof.block_size),
            running=running,
            waiting_prompt_lens=w.prompt_tokens_to_compute(),
            recent_steps=tuple(self._steps[w.worker_id]),
            kv_bytes_per_token=prof.kv_bytes_per_token,
            max_num_seqs=prof.max_num_seqs,
            prefix_digest=self._prefixes.digest(w.worker_id),
            prefill_budget_tokens=w.budget_tokens,
            long_prefill_tokens=w.long_prefill_tokens,
            waiting_image_tokens=w.image_tokens_to_encode(),
        )
