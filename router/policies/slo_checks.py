"""``slo_goodput``'s checks over a ``WorkerTable``, apart from the plan that uses them:
the colocated TPOT a prompt's chunks cause, the decode worker a candidate's
past-future peak fits on, and the refusal when nothing is feasible. Functions of the
table and their arguments only: the policy object (``router.policies.slo_goodput``)
keeps the state."""

from __future__ import annotations

import numpy as np

from router.types import Reject, Role
from router.worker_table import WorkerTable

__all__ = ["any_true", "best_prefill_s", "colocated_tpot_s", "pick_decode", "refusal"]


def any_true(mask: np.ndarray) -> bool:
    """``mask.any()`` without the Python wrapper ``ndarray.any`` goes through."""
    return bool(np.count_nonzero(mask))


def colocated_tpot_s(t: WorkerTable, n: float | np.ndarray, mean_output_len: float) -> np.ndarray:
    """Each worker's mean step with an ``n``-token prompt prefilled there (colocated).

    TPOT is a request's mean step time: each chunk stalls one step of every running
    sequence by its excess over a plain step, once, and that stall is spread over
    the sequence's output tokens. So the stalls of what is queued there and of this
    prompt count spread over the mean output length. (Judged per step, as if TPOT
    bounded each gap, a busy mixed worker took no prompt at all: on the memory-bound
    workload, whose outputs of thousands of tokens each absorb a stall, every
    colocated request was held and refused.)"""
    if not any_true(t.chunk_tokens):
        return t.step_base_s  # no worker prefills in chunks: no stall (+ 0.0 exactly)
    queued = t.queued_tokens + n
    chunks = np.ceil(queued / np.maximum(t.chunk_tokens, 1.0))
    stall_s = chunks * t.chunk_fixed_s + t.chunk_s_per_token * queued
    out: np.ndarray = t.step_base_s + stall_s / mean_output_len
    return out


def pick_decode(
    t: WorkerTable,
    ok: np.ndarray,
    sure: np.ndarray,
    preference: np.ndarray,
    held_q: float,
    r_q: list[float],
    limit: np.ndarray,
    max_exact_checks: int,
) -> int:
    """The most preferred ``ok`` worker whose peak with the candidate fits, or -1.

    ``sure`` workers fit by the upper bound (peak + c_q + max r_q); the others
    among ``ok`` already passed the lower bound and are priced exactly, most
    preferred first, only where they beat the best sure one, at most
    ``max_exact_checks`` of them."""
    best, best_pref = -1, -np.inf
    fits = ok & sure
    if any_true(fits):
        best = int(np.where(fits, preference, -np.inf).argmax())
        best_pref = float(preference[best])
    better = (ok & (preference > best_pref)).nonzero()[0]
    if better.size:
        r_q_array = np.array(r_q)
        better = better[~sure[better]]
        order = better[(-preference[better]).argsort(kind="stable")]
        for i in order[:max_exact_checks]:
            table = t.tables[i]
            if table is not None and table.peak_with(held_q, r_q_array) < limit[i]:
                return int(i)
    return best


def best_prefill_s(
    t: WorkerTable, ttft_s: np.ndarray | float, colocate_roles: tuple[Role, ...]
) -> float:
    """The least of ``ttft_s`` over the workers that can prefill."""
    prefill_capable = t.in_roles((Role.PREFILL, *colocate_roles))
    return float(np.min(np.where(prefill_capable, ttft_s, np.inf)))


def refusal(
    t: WorkerTable,
    ttft_local: np.ndarray,
    decodable: np.ndarray,
    budget_s: float,
    *,
    colocate_roles: tuple[Role, ...],
    hold: bool,
    hold_retry_s: float,
    min_retry_after_s: float,
    hopeless: bool,
) -> Reject:
    """Nothing feasible: why, and whether to hold (``hold``: an interactive request
    within its hold time, kept while its TTFT target is still reachable) or when to
    retry. ``hopeless``: even an idle worker's prefill misses the TTFT target (not
    ``retryable``)."""
    prefill_capable = t.in_roles((Role.PREFILL, *colocate_roles))
    if not prefill_capable.any() or not t.in_roles((Role.DECODE, *colocate_roles)).any():
        return Reject("no live worker", retry_after_s=min_retry_after_s)
    best_ttft_s = best_prefill_s(t, ttft_local, colocate_roles)
    if best_ttft_s > budget_s:
        reason = "ttft target unreachable"
    elif not decodable.any():
        reason = "no decode capacity within memory and tpot"
    else:
        reason = "no pair meets both targets"
    if best_ttft_s <= budget_s and hold:
        return Reject(reason, retry_after_s=hold_retry_s, hold=True)
    best_wait_s = float(np.min(np.where(prefill_capable, t.wait_short_s, np.inf)))
    retry_after_s = max(min_retry_after_s, best_wait_s)
    return Reject(reason, retry_after_s=retry_after_s, retryable=not hopeless)
