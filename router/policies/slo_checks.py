"""``slo_goodput``'s checks over a ``WorkerTable``, apart from the plan that uses them:
the tokens a request prefills on each worker, the colocated TPOT a prompt's chunks
cause, the decode worker a candidate's past-future peak fits on, the refusal when
nothing is feasible, and each role's pressure for the ratio planner. Functions of the
table and their arguments only: the policy object (``router.policies.slo_goodput``)
keeps the state."""

from __future__ import annotations

import math

import numpy as np

from router.length import effective_prefill_tokens
from router.planner import RolePressure
from router.types import SLO, Reject, RequestProfile, Role
from router.worker_table import WorkerTable

__all__ = [
    "any_true",
    "best_prefill_s",
    "colocated_tpot_s",
    "pick_decode",
    "prefill_tokens",
    "refusal",
    "table_pressure",
]


def any_true(mask: np.ndarray) -> bool:
    """``mask.any()`` without the Python wrapper ``ndarray.any`` goes through."""
    return bool(np.count_nonzero(mask))


def prefill_tokens(
    t: WorkerTable, profile: RequestProfile, prefilling_codes: frozenset[int]
) -> tuple[np.ndarray | float, float]:
    """Effective prefill tokens: per worker from the prefix digests, else the gateway's;
    and the fewest among the usable workers whose role code is in ``prefilling_codes``."""
    if not profile.prefix_hashes:
        least = float(max(1, effective_prefill_tokens(profile)))
        n: np.ndarray | float = least
    else:
        matched = t.prefix_index.matched_blocks(profile.prefix_hashes)
        total = float(profile.num_prompt_tokens + profile.num_image_tokens)
        n = np.empty(len(t.role))
        n.fill(total)
        least = total
        block_size, role, usable = t.block_size, t.role, t.usable
        for index, blocks in matched.items():  # a few workers: Python floats, same values
            tokens = max(1.0, total - blocks * float(block_size[index]))
            n[index] = tokens
            if tokens < least and usable[index] and int(role[index]) in prefilling_codes:
                least = tokens
    return n, least


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


def table_pressure(
    t: WorkerTable, mean_prompt_tokens: float, slo: SLO, mean_output_len: float, encode_b: float
) -> RolePressure:
    """Each role's load against its target, averaged over its usable workers, for the
    ratio planner: prefill TTFT of a typical prompt behind today's queues, decode
    estimated peak KV fraction and step time with one more request (``encode_b``: the
    encode term's seconds per image token)."""
    prefill, decode = t.is_role(Role.PREFILL), t.is_role(Role.DECODE)
    mixed = t.is_role(Role.MIXED)
    n = mean_prompt_tokens
    ttft_s = t.wait_long_s + t.pa + n * (t.pb + n * t.pc)
    encode = t.is_role(Role.ENCODE)
    return RolePressure(
        predicted_ttft_s=float(ttft_s[prefill].mean()) if prefill.any() else 0.0,
        ttft_target_s=slo.ttft_s or math.inf,
        decode_peak_fraction=float(t.fullness[decode].mean()) if decode.any() else 0.0,
        predicted_tpot_s=float(t.step_base_s[decode].mean()) if decode.any() else 0.0,
        tpot_target_s=slo.tpot_s or math.inf,
        encode_wait_s=encode_b * float(t.queued_tokens[encode].mean()) if encode.any() else 0.0,
        mixed_ttft_s=float(ttft_s[mixed].mean()) if mixed.any() else 0.0,
        mixed_tpot_s=float(colocated_tpot_s(t, n, mean_output_len)[mixed].mean())
        if mixed.any()
        else 0.0,
    )
