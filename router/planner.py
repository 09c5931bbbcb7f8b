"""The P/D ratio planner: how many prefill and decode workers, and when to flip one.

*Sizing* for a target arrival rate, from the cost model:

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

*Flipping* one worker between roles (``RatioPlanner.decide``), at most once per
interval: each role's pressure is predicted TTFT / target (prefill) or the
larger of peak KV fraction and predicted TPOT / target (decode); pressure is
taken to scale as ``1/pool size``. A flip happens only when moving one worker
lowers the larger pressure by more than ``hysteresis``, and never empties a pool.
With encode workers, the encode pool's pressure (its predicted queue wait / the
TTFT target) is weighed against prefill's the same way when P and D are balanced:
one worker moves between the encode and prefill pools.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from router.cost_model import CostModel, Profile
from router.types import SLO, ClusterView, Role, WorkerView

__all__ = [
    "Flip",
    "PoolPlan",
    "RatioPlanner",
    "RoleFlip",
    "RolePressure",
    "WorkloadStats",
    "choose_flip",
    "plan_pools",
    "size_pools",
]


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
    predicted_ttft_s: float  # M/D/1 at the planned size, plus transfer
    decode_batch: int  # B per decode worker
    decode_step_s: float  # step time at B

    def to_dict(self) -> dict[str, float | int]:
        return {
            "num_prefill": self.num_prefill,
            "num_decode": self.num_decode,
            "prefill_s": self.prefill_s,
            "predicted_ttft_s": self.predicted_ttft_s,
            "decode_batch": self.decode_batch,
            "decode_step_s": self.decode_step_s,
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

    num_prefill = max(1, math.ceil(rate_per_s * prefill_s / max_utilization))
    ttft_s = _md1_ttft_s(rate_per_s / num_prefill, prefill_s) + transfer_s
    while ttft_s > ttft_target_s and num_prefill < max_workers:
        num_prefill += 1
        ttft_s = _md1_ttft_s(rate_per_s / num_prefill, prefill_s) + transfer_s

    batch, step_s = _largest_decode_batch(model, profile, workload, slo, memory_fraction)
    in_flight = rate_per_s * workload.mean_output_tokens * step_s
    num_decode = max(1, math.ceil(in_flight / batch))
    return PoolPlan(num_prefill, min(num_decode, max_workers), prefill_s, ttft_s, batch, step_s)


def size_pools(
    rate_per_s: float, profile: Profile, workload: WorkloadStats, slo: SLO
) -> tuple[int, int]:
    """``(n_p, n_d)`` for ``rate_per_s`` requests per second; see ``plan_pools``."""
    plan = plan_pools(rate_per_s, profile, workload, slo)
    return plan.num_prefill, plan.num_decode


def _largest_decode_batch(
    model: CostModel, profile: Profile, workload: WorkloadStats, slo: SLO, memory_fraction: float
) -> tuple[int, float]:
    tpot_s = slo.tpot_s if slo.tpot_s is not None else math.inf
    capacity = memory_fraction * profile.num_kv_blocks * profile.block_size
    per_request_peak = workload.mean_prompt_tokens + workload.mean_output_tokens
    mean_context = workload.mean_prompt_tokens + workload.mean_output_tokens / 2
    best = 1
    for batch in range(1, profile.max_num_seqs + 1):
        fits_memory = batch * per_request_peak <= capacity
        fits_tpot = model.decode_step_s(batch, batch * mean_context) <= tpot_s
        if not (fits_memory and fits_tpot):
            break
        best = batch
    return best, model.decode_step_s(best, best * mean_context)


class Flip(enum.StrEnum):
    NONE = "none"
    DECODE_TO_PREFILL = "decode_to_prefill"
    PREFILL_TO_DECODE = "prefill_to_decode"
    ENCODE_TO_PREFILL = "encode_to_prefill"
    PREFILL_TO_ENCODE = "prefill_to_encode"


@dataclass(frozen=True, slots=True)
class RolePressure:
    """One interval's observations; 1.0 means exactly at target."""

    predicted_ttft_s: float
    ttft_target_s: float
    decode_peak_fraction: float  # estimated peak KV / capacity, averaged over decode workers
    predicted_tpot_s: float
    tpot_target_s: float
    encode_wait_s: float = 0.0  # predicted queue wait on an encode worker, averaged

    @property
    def prefill(self) -> float:
        return self.predicted_ttft_s / self.ttft_target_s

    @property
    def encode(self) -> float:
        return self.encode_wait_s / self.ttft_target_s

    @property
    def decode(self) -> float:
        return max(self.decode_peak_fraction, self.predicted_tpot_s / self.tpot_target_s)


class RatioPlanner:
    def __init__(self, interval_s: float = 10.0, hysteresis: float = 0.1) -> None:
        self.interval_s = interval_s
        self.hysteresis = hysteresis
        self._last_flip_s = -math.inf

    def decide(
        self,
        now_s: float,
        pressure: RolePressure,
        num_prefill: int,
        num_decode: int,
        num_encode: int = 0,
    ) -> Flip:
        if now_s - self._last_flip_s < self.interval_s:
            return Flip.NONE
        p, d = pressure.prefill, pressure.decode
        worst = max(p, d)
        flip = Flip.NONE
        if num_encode:
            flip = self._encode_flip(pressure, num_prefill, num_encode, worst)
            if flip is not Flip.NONE:
                self._last_flip_s = now_s
                return flip
        if num_decode > 1 and p > d:
            after = max(p * num_prefill / (num_prefill + 1), d * num_decode / (num_decode - 1))
            if after < worst - self.hysteresis:
                flip = Flip.DECODE_TO_PREFILL
        elif num_prefill > 1 and d > p:
            after = max(d * num_decode / (num_decode + 1), p * num_prefill / (num_prefill - 1))
            if after < worst - self.hysteresis:
                flip = Flip.PREFILL_TO_DECODE
        if flip is not Flip.NONE:
            self._last_flip_s = now_s
        return flip

    def _encode_flip(
        self, pressure: RolePressure, num_prefill: int, num_encode: int, worst_pd: float
    ) -> Flip:
        """Between the encode and prefill pools, when that lowers the worst pressure."""
        e, p = pressure.encode, pressure.prefill
        worst = max(worst_pd, e)
        if e > p and e >= worst_pd and num_prefill > 1:
            after = max(e * num_encode / (num_encode + 1), p * num_prefill / (num_prefill - 1))
            if after < worst - self.hysteresis:
                return Flip.PREFILL_TO_ENCODE
        elif p > e and p >= worst_pd and num_encode > 1:
            after = max(p * num_prefill / (num_prefill + 1), e * num_encode / (num_encode - 1))
            if after < worst - self.hysteresis:
                return Flip.ENCODE_TO_PREFILL
        return Flip.NONE


@dataclass(frozen=True, slots=True)
class RoleFlip:
    worker_id: str
    source: Role
    target: Role


_FLIPS = {
    Flip.DECODE_TO_PREFILL: (Role.DECODE, Role.PREFILL),
    Flip.PREFILL_TO_DECODE: (Role.PREFILL, Role.DECODE),
    Flip.ENCODE_TO_PREFILL: (Role.ENCODE, Role.PREFILL),
    Flip.PREFILL_TO_ENCODE: (Role.PREFILL, Role.ENCODE),
}


def choose_flip(
    view: ClusterView, pressure: RolePressure, planner: RatioPlanner, now_s: float
) -> RoleFlip | None:
    """The planner's decision as the worker to flip: the least busy of the role that
    gives one up (draining workers are not counted). The gateway's rebalancer and the
    simulator both apply this; issue 14's learned rebalancing replaces it here."""
    prefill, decode = view.by_role(Role.PREFILL), view.by_role(Role.DECODE)
    encode = view.by_role(Role.ENCODE)
    flip = planner.decide(now_s, pressure, len(prefill), len(decode), len(encode))
    if flip is Flip.NONE:
        return None
    source, target = _FLIPS[flip]
    pools = {Role.PREFILL: prefill, Role.DECODE: decode, Role.ENCODE: encode}
    worker = min(pools[source], key=_busyness)
    return RoleFlip(worker.worker_id, source, target)


def _busyness(w: WorkerView) -> tuple[int, int]:
    return len(w.running), sum(w.queued_tokens.values())
