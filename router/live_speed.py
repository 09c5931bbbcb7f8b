"""How fast a worker runs now, from its last few reported steps: what admission prices
a plan at where the cost model, fitted over hundreds of steps, lags (``Router``'s
``pending_age_s``, ``recent_step_s`` and ``recent_slowdown`` call these)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from router.cost_model import CostModel
from router.reservations import Reservations
from router.types import Role, StepSample, WorkerReport

__all__ = [
    "MAX_COMPUTE_SLOWDOWN",
    "NO_SLOWDOWN",
    "RECENT_STEPS",
    "JudgedSpeeds",
    "Slowdown",
    "pending_age_s",
    "recent_slowdown",
    "recent_step_s",
    "recent_steps",
    "shared_step_deadline_s",
]

RECENT_STEPS = 3  # decode steps whose median is the worker's speed now
# The most a worker's compute slows under contention (a shared host's cores, a GPU's
# neighbours): a step slower than that against its model spent the rest waiting.
MAX_COMPUTE_SLOWDOWN = 4.0


@dataclass(frozen=True, slots=True)
class Slowdown:
    """How a worker's last steps ran against its cost model: its compute ``scale``
    times slower (at most ``MAX_COMPUTE_SLOWDOWN``), and ``wait_s`` more per step that
    did not scale with the work (its process pre-empted on a shared host, or its engine
    loop held up by a KV transfer in another thread). ``Slowdown()``: none known.

    Measured live on a host with one core taken (2 prefill + 2 decode, 48 req/s): a
    1-sequence decode step modelled at 1-3 ms ran 2 ms, then 35, then 50: 10-78x its
    model. Priced as a ratio, a 7 ms plan became 0.55 s, past a 0.2 s TPOT target, and
    admission refused requests whose TPOT came out at 34 ms (p50) and 79 ms (p90)."""

    scale: float = 0.0
    wait_s: float = 0.0

    def price(self, modelled_s: float) -> float:
        """What a step (or steps) modelled at ``modelled_s`` takes at this speed; 0 when
        none is known."""
        return modelled_s * self.scale + self.wait_s if self.scale > 0.0 else 0.0


NO_SLOWDOWN = Slowdown()


def pending_age_s(reservations: Reservations, worker_id: str, now_s: float) -> float:
    """How long the oldest request placed to prefill on ``worker_id`` has waited
    without its first event (0 with none): the worker's queue as it is now, however
    slowly it runs, where the view shows it as last reported and as modelled."""
    for r in reservations.placed(worker_id, prefill=True):  # oldest first
        if r.placed_s is not None:
            return max(0.0, now_s - r.placed_s)
    return 0.0


def shared_step_deadline_s(
    report: WorkerReport | None, reservations: Reservations, worker_id: str
) -> float:
    """The earliest first-token deadline among the prompts that a new prompt placed to
    prefill on ``worker_id`` now would share an engine step with (any chunk of it that
    fits their step's token budget): inf where it would share none (none waits, or the
    waiting fill the step).

    An engine step takes every waiting prompt up to its token budget, and each one's
    first token comes when the step ends. The prompts placed since the worker's last
    report (which comes as a step ends) wait for the step after the one running now;
    a new prompt that joins them makes that step, and their first tokens, later by its
    own prefill. Priced only by the queue ahead of it, each newcomer looked fine while
    the ones before it in the same step went past their targets: live, at 2x the
    saturation rate (2 prefill + 2 decode, 2 AVX2 cores), prefill steps held 1000-1220
    tokens and took 3.7-6.6 s, and admitted requests missed their TTFT in groups of
    2-16 placed within a second or two, predicted 2-9 s and served in 8-12 s against
    a 9-10 s target."""
    if report is None:
        return math.inf
    budget = report.prefill_budget_tokens
    if report.role is not Role.PREFILL:
        budget -= len(report.running)  # a colocated step decodes its running ones first
    if budget <= 0:
        return math.inf
    tokens, deadline_s = 0, math.inf
    for r in reservations.placed(worker_id, prefill=True):
        if r.placed_seq == report.seq:
            tokens += r.prefill_tokens
            deadline_s = min(deadline_s, r.deadline_s)
    return deadline_s if tokens < budget else math.inf


def recent_steps(
    report: WorkerReport | None,
    reservations: Reservations,
    worker_id: str,
    *,
    prefill: bool,
    placed: bool = False,
) -> list[StepSample]:
    """The last few decode-only steps (``prefill``: steps that prefilled) that the
    worker reported, while it has that work now (runs a request, or with ``placed`` has
    one placed to decode there; ``prefill``: has a prompt waiting or placed on it);
    none otherwise."""
    if report is None:
        return []
    if prefill:
        waiting = next(reservations.placed(worker_id, prefill=True), None)
        busy = bool(report.waiting_prompt_lens) or waiting is not None
    else:
        busy = bool(report.running) or (
            placed and next(reservations.placed(worker_id, prefill=False), None) is not None
        )
    if not busy:
        return []
    steps = [s for s in report.recent_steps if (s.num_prefill_tokens > 0) == prefill]
    return steps[-RECENT_STEPS:]


def recent_step_s(report: WorkerReport | None, reservations: Reservations, worker_id: str) -> float:
    """The median of the last few decode steps the worker reported while it runs
    requests (0 when it runs none: an idle worker's old steps say nothing of the next
    one): the decode worker's speed as it is now."""
    steps = recent_steps(report, reservations, worker_id, prefill=False)
    return statistics.median(s.duration_s for s in steps) if steps else 0.0


def recent_slowdown(
    report: WorkerReport | None,
    reservations: Reservations,
    worker_id: str,
    cost_model: Callable[[str], CostModel] | None,
    *,
    prefill: bool = False,
) -> Slowdown:
    """How much slower than its cost ``model`` the worker's last few decode steps
    (``prefill``: steps that prefilled) ran while it has that work: the medians of
    each step's compute scale and wait (``Slowdown``); ``Slowdown()`` when it has none
    (runs no request and has none placed to decode there; ``prefill``: has no prompt
    waiting or placed on it) or the policy keeps no cost model (``cost_model``: the
    policy's model of a worker, or None). The model is fitted from the same steps but
    over hundreds, each weighed by its relative error, which favours the fast ones:
    where the speed has just fallen (a loaded host, a grown batch on a CPU that
    computes it no faster), this knows it at once. It is per step of whatever batch
    ran, so an idle decode worker's last steps still price a burst placed on it: the
    first request goes by the plan's own prediction, the ones after at that speed
    (live, 2 prefill + 2 decode offered 48 req/s after a pause: 85 requests were
    admitted in the first 2 s on the model's figures alone, 35 of them missed TPOT,
    and the grown batches locked everyone out for 6 s while they drained)."""
    steps = recent_steps(report, reservations, worker_id, prefill=prefill, placed=True)
    if cost_model is None or not steps:
        return NO_SLOWDOWN
    model = cost_model(worker_id)
    scales, waits = [], []
    for s in steps:
        modelled = model.sample_s(s)  # its encodes included, where it ran any
        if modelled > 0:
            scale = s.duration_s / modelled
            scales.append(min(scale, MAX_COMPUTE_SLOWDOWN))
            waits.append(max(0.0, s.duration_s - MAX_COMPUTE_SLOWDOWN * modelled))
    if not scales:
        return NO_SLOWDOWN
    return Slowdown(statistics.median(scales), statistics.median(waits))


class JudgedSpeeds:
    """Per worker, the speed (``Slowdown.scale``) its plans were judged at lately: a mean
    over about ``horizon_s`` (each sample's weight decays as ``exp(-age / horizon_s)``).

    A learned correction (``router.correction``) is fitted on plans judged at about
    this speed, so it already prices a worker that steadily runs this much slower than
    its cost model; only a speed past it is news to the correction."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._mean: dict[str, tuple[float, float]] = {}  # worker -> (mean scale, when)

    def reference(self, worker_id: str) -> float:
        """The mean scale judged at lately (0 with none yet)."""
        known = self._mean.get(worker_id)
        return 0.0 if known is None else known[0]

    def observe(self, worker_id: str, scale: float, now_s: float) -> None:
        known = self._mean.get(worker_id)
        if known is None:
            self._mean[worker_id] = (scale, now_s)
            return
        mean, at_s = known
        weight = 1.0 - math.exp(-max(0.0, now_s - at_s) / self.horizon_s)
        self._mean[worker_id] = (mean + weight * (scale - mean), max(at_s, now_s))

    def forget(self, worker_id: str) -> None:
        self._mean.pop(worker_id, None)
