"""How fast a worker runs now, from its last few reported steps: what admission prices
a plan at where the cost model, fitted over hundreds of steps, lags (``Router``'s
``pending_age_s``, ``recent_step_s`` and ``recent_slowdown`` call these)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from router.cost_model import CostModel
from router.reservations import Reservations
from router.types import StepSample, WorkerReport

__all__ = ["RECENT_STEPS", "pending_age_s", "recent_slowdown", "recent_step_s", "recent_steps"]

RECENT_STEPS = 3  # decode steps whose median is the worker's speed now


def pending_age_s(reservations: Reservations, worker_id: str, now_s: float) -> float:
    """How long the oldest request placed to prefill on ``worker_id`` has waited
    without its first event (0 with none): the worker's queue as it is now, however
    slowly it runs, where the view shows it as last reported and as modelled."""
    for r in reservations.placed(worker_id, prefill=True):  # oldest first
        if r.placed_s is not None:
            return max(0.0, now_s - r.placed_s)
    return 0.0


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
) -> float:
    """How much slower than its cost ``model`` the worker's last few decode steps
    (``prefill``: steps that prefilled) ran while it has that work: the median of
    measured / modelled; 0 when it has none (runs no request and has none placed to
    decode there; ``prefill``: has no prompt waiting or placed on it) or the policy
    keeps no cost model (``cost_model``: the policy's model of a worker, or None). The model is fitted from the same steps but over hundreds, each weighed by
    its relative error, which favours the fast ones: where the speed has just fallen (a
    loaded host, a grown batch on a CPU that computes it no faster), this ratio knows
    it at once. A ratio is per step of whatever batch ran, so an idle decode worker's
    last steps still price a burst placed on it: the first request goes by the plan's
    own prediction, the ones after it at that speed (live, 2 prefill + 2 decode
    offered 48 req/s after a pause: 85 requests were admitted in the first 2 s on the
    model's figures alone, 35 of them missed TPOT, and the grown batches locked
    everyone out for 6 s while they drained)."""
    steps = recent_steps(report, reservations, worker_id, prefill=prefill, placed=True)
    if cost_model is None or not steps:
        return 0.0
    model = cost_model(worker_id)
    ratios = []
    for s in steps:
        modelled = model.step_s(s.num_prefill_tokens, s.num_decode_seqs, s.total_context_tokens)
        if modelled > 0:
            ratios.append(s.duration_s / modelled)
    return statistics.median(ratios) if ratios else 0.0
