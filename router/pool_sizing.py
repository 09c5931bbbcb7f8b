"""Sizing the P/D pools for a target arrival rate, from the cost model (``baton plan``).

* prefill: one request costs ``D = prefill(n)`` seconds for its effective
  prompt ``n``; ``n_p = ⌈rate·D/ρ⌉`` workers keep each under utilisation ``ρ``,
  then more are added until the M/D/1 queueing estimate of TTFT,
  ``D + R·D² / (2(1 − R·D))`` at per-worker rate ``R = rate/n_p``, plus the KV
  transfer, meets the TTFT target (DistServe's intuition).
* decode: the largest batch ``B`` whose step time at average context
  ``B·(prompt + output/2)`` meets TPOT and whose peak KV ``B·(prompt + output)``
  fits ``memory_fraction`` of capacity (and ``max_num_seqs``); by Little's law
  ``rate·output·step(B)`` requests are decoding at once, so
  ``n_d = ⌈rate·output·step(B) / B⌉``.

A target that no pool can meet (one prefill alone slower than the TTFT target, one
request's decode step slower than the TPOT target, one request's KV larger than the
memory) is not sized for: the plan keeps the pools the rest asks for and says what
cannot be met, and why, in ``shortfalls``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.cost_model import CostModel
from router.profile import Profile
from router.types import SLO

__all__ = ["PoolPlan", "WorkloadStats", "plan_pools", "size_pools"]


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    mean_prompt_tokens: float
    mean_output_tokens: float
    mean_prefix_hit_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class PoolPlan:
    num_prefill: int
    num_decode: int
    prefill_s: float  # one request's prefill, D
    predicted_ttft_s: float  # M/D/1 at the planned size, plus transfer (inf: overloaded)
    decode_batch: int  # B per decode worker
    decode_step_s: float  # step time at B
    shortfalls: tuple[str, ...] = ()  # each target no pool meets, and why

    def to_dict(self) -> dict[str, object]:
        return {
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "prefill_s": self.prefill_s,
            # None where no TTFT is reached (the planned pool cannot keep up).
            "predicted_ttft_s": (
                self.predicted_ttft_s if math.isfinite(self.predicted_ttft_s) else None
            ),
            "decode_batch": self.decode_batch,
            "decode_step_s": self.decode_step_s,
            "meets_targets": not self.shortfalls,
            "shortfalls": list(self.shortfalls),
        }


def _md1_ttft_s(rate_per_worker: float, service_s: float) -> float:
    load = rate_per_worker * service_s
    if load >= 1.0:
        return math.inf
    return service_s + rate_per_worker * service_s**2 / (2 * (1 - load))


def plan_pools(
    rate_per_s: float,
    profile: Profile,
    workload: WorkloadStats,
    slo: SLO,
    max_utilization: float = 0.8,
    memory_fraction: float = 0.95,
    max_workers: int = 4096,
) -> PoolPlan:
    if rate_per_s <= 0 or not 0 < max_utilization < 1:
        raise ValueError("need rate_per_s > 0 and 0 < max_utilization < 1")
    model = CostModel(profile)
    n_eff = max(1.0, workload.mean_prompt_tokens - workload.mean_prefix_hit_tokens)
    prefill_s = model.prefill_s(n_eff)
    transfer_s = model.transfer_s(workload.mean_prompt_tokens * profile.kv_bytes_per_token)
    ttft_target_s = slo.ttft_s if slo.ttft_s is not None else math.inf

    def ttft_at(num_prefill: int) -> float:  # M/D/1 over the pool, plus the transfer
        return _md1_ttft_s(rate_per_s / num_prefill, prefill_s) + transfer_s

    shortfalls = []
    needed = max(1, math.ceil(rate_per_s * prefill_s / max_utilization))
    num_prefill = min(needed, max_workers)  # TTFT is predicted at the size planned
    if needed > max_workers:
        shortfalls.append(
            f"the rate needs {needed} prefill workers, more than the most planned ({max_workers})"
        )
    if prefill_s + transfer_s >= ttft_target_s:  # no queue at all would still miss it
        shortfalls.append(
            f"no prefill pool meets the TTFT target of {ttft_target_s * 1e3:g} ms: one "
            f"prompt of {n_eff:g} tokens takes {prefill_s * 1e3:.1f} ms to prefill, plus "
            f"{transfer_s * 1e3:.1f} ms of KV transfer"
        )
    else:
        while ttft_at(num_prefill) > ttft_target_s and num_prefill < max_workers:
            num_prefill += 1
        ttft_s = ttft_at(num_prefill)
        if ttft_s > ttft_target_s and needed <= max_workers:  # else named above
            shortfalls.append(
                f"{max_workers} prefill workers (the most planned) predict a TTFT of "
                f"{ttft_s * 1e3:.1f} ms, above the target of {ttft_target_s * 1e3:g} ms"
            )

    batch, step_s, why_not = _largest_decode_batch(model, profile, workload, slo, memory_fraction)
    shortfalls += why_not
    in_flight = rate_per_s * workload.mean_output_tokens * step_s
    num_decode = max(1, math.ceil(in_flight / batch))
    if num_decode > max_workers:
        shortfalls.append(
            f"the rate needs {num_decode} decode workers, more than the most planned "
            f"({max_workers})"
        )
    return PoolPlan(
        num_prefill,
        min(num_decode, max_workers),
        prefill_s,
        ttft_at(num_prefill),
        batch,
        step_s,
        tuple(shortfalls),
    )


def size_pools(
    rate_per_s: float, profile: Profile, workload: WorkloadStats, slo: SLO
) -> tuple[int, int]:
    """``(n_p, n_d)`` for ``rate_per_s`` requests per second; see ``plan_pools``."""
    plan = plan_pools(rate_per_s, profile, workload, slo)
    return plan.num_prefill, plan.num_decode


def _largest_decode_batch(
    model: CostModel, profile: Profile, workload: WorkloadStats, slo: SLO, memory_fraction: float
) -> tuple[int, float, list[str]]:
    """The batch ``B``, its step time, and why not even one request fits (if so)."""
    tpot_s = slo.tpot_s if slo.tpot_s is not None else math.inf
    capacity = memory_fraction * profile.num_kv_blocks * profile.block_size
    per_request_peak = workload.mean_prompt_tokens + workload.mean_output_tokens
    mean_context = workload.mean_prompt_tokens + workload.mean_output_tokens / 2
    why_not = []
    one_step_s = model.decode_step_s(1, mean_context)
    if one_step_s > tpot_s:
        why_not.append(
            f"no decode pool meets the TPOT target of {tpot_s * 1e3:g} ms: a decode step "
            f"of one request ({mean_context:g} tokens of context) takes {one_step_s * 1e3:.1f} ms"
        )
    if per_request_peak > capacity:
        why_not.append(
            f"one request's KV ({per_request_peak:g} tokens: prompt and output) does not fit "
            f"a decode worker ({capacity:g} tokens, {memory_fraction:g} of its KV blocks)"
        )
    best = 1
    for batch in range(1, profile.max_num_seqs + 1):
        fits_memory = batch * per_request_peak <= capacity
        fits_tpot = model.decode_step_s(batch, batch * mean_context) <= tpot_s
        if not (fits_memory and fits_tpot):
            break
        best = batch
    return best, model.decode_step_s(best, best * mean_context), why_not
