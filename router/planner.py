"""The P/D ratio planner: when to flip one worker between roles (how many of each a
target rate needs is ``router.pool_sizing``).

``RatioPlanner.decide`` flips at most one worker per interval: each role's pressure
is predicted TTFT / target (prefill) or the larger of peak KV fraction and predicted
TPOT / target (decode); a mixed worker's is the larger of its TTFT and its TPOT (its
mean step, with the stalls of the prefill chunks queued there spread over the mean
output) against their targets. Pressure is taken to scale as ``1/pool size``. Both ways:

* prefill <-> decode when moving one worker lowers the larger pressure by more
  than ``hysteresis`` (never emptying a pool);
* dedicated -> mixed when that is not possible (the giving pool has one worker)
  but pooling the load over every worker, ``(p·n_p + d·n_d)/(n_p + n_d)``, would
  lower the worst pressure by more than ``hysteresis``: the least pressed role
  gives a worker first, so a 1 prefill + 1 decode cluster becomes 2 mixed in two
  steps;
* mixed -> dedicated when the mixed workers miss TPOT (above ``1 + hysteresis``:
  chunked prefills stall their decodes) and the dedicated pools have room: to
  decode while the prompts' TTFT, pooled over one prefilling worker fewer, stays
  below that miss, else (the last worker that prefills) to prefill, handing its
  decodes to the decode pool; never on a TTFT miss (no dedicated role prefills
  more), never leaving no worker that can prefill or decode;
* encode <-> prefill, weighed first when there are encode workers: the encode
  pool's pressure (its predicted queue wait / the TTFT target) against prefill's,
  the same way (never emptying the encode pool).

A worker that flipped stays in its role for ``min_dwell_s`` (``choose_flip``
skips it), and no flip undoes the last one (another worker, the other way) within
``min_dwell_s``: the pressures right after a flip still carry the queues it was
made for (live, on 2 prefill + 2 decode workers, decode -> prefill was followed two
seconds later by prefill -> decode, and back again). The drain before a flip is
the applier's (controller or simulator).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from router.types import ClusterView, Role, WorkerView

__all__ = ["Flip", "RatioPlanner", "RoleFlip", "RolePressure", "choose_flip"]


class Flip(enum.StrEnum):
    NONE = "none"
    DECODE_TO_PREFILL = "decode_to_prefill"
    PREFILL_TO_DECODE = "prefill_to_decode"
    ENCODE_TO_PREFILL = "encode_to_prefill"
    PREFILL_TO_ENCODE = "prefill_to_encode"
    PREFILL_TO_MIXED = "prefill_to_mixed"
    DECODE_TO_MIXED = "decode_to_mixed"
    MIXED_TO_PREFILL = "mixed_to_prefill"
    MIXED_TO_DECODE = "mixed_to_decode"


_REVERSE = {
    Flip.DECODE_TO_PREFILL: Flip.PREFILL_TO_DECODE,
    Flip.PREFILL_TO_DECODE: Flip.DECODE_TO_PREFILL,
    Flip.ENCODE_TO_PREFILL: Flip.PREFILL_TO_ENCODE,
    Flip.PREFILL_TO_ENCODE: Flip.ENCODE_TO_PREFILL,
    Flip.PREFILL_TO_MIXED: Flip.MIXED_TO_PREFILL,
    Flip.MIXED_TO_PREFILL: Flip.PREFILL_TO_MIXED,
    Flip.DECODE_TO_MIXED: Flip.MIXED_TO_DECODE,
    Flip.MIXED_TO_DECODE: Flip.DECODE_TO_MIXED,
}


@dataclass(frozen=True, slots=True)
class RolePressure:
    """One interval's observations; 1.0 means exactly at target."""

    predicted_ttft_s: float
    ttft_target_s: float
    decode_peak_fraction: float  # estimated peak KV / capacity, averaged over decode workers
    predicted_tpot_s: float
    tpot_target_s: float
    encode_wait_s: float = 0.0  # predicted queue wait on an encode worker, averaged
    mixed_ttft_s: float = 0.0  # averaged over mixed workers (0: none)
    mixed_tpot_s: float = 0.0  # their mean step, with their queued chunks' stalls

    @property
    def prefill(self) -> float:
        return self.predicted_ttft_s / self.ttft_target_s

    @property
    def encode(self) -> float:
        return self.encode_wait_s / self.ttft_target_s

    @property
    def decode(self) -> float:
        return max(self.decode_peak_fraction, self.predicted_tpot_s / self.tpot_target_s)

    @property
    def mixed_ttft(self) -> float:
        return self.mixed_ttft_s / self.ttft_target_s

    @property
    def mixed_tpot(self) -> float:
        return self.mixed_tpot_s / self.tpot_target_s

    @property
    def mixed(self) -> float:
        return max(self.mixed_ttft, self.mixed_tpot)


class RatioPlanner:
    def __init__(
        self, interval_s: float = 10.0, hysteresis: float = 0.1, min_dwell_s: float | None = None
    ) -> None:
        self.interval_s = interval_s
        self.hysteresis = hysteresis
        self.min_dwell_s = 3 * interval_s if min_dwell_s is None else min_dwell_s
        self._last_flip_s = -math.inf
        self._last_flip = Flip.NONE
        self._before_last = (-math.inf, Flip.NONE)  # what the two above were before it
        self._flipped_s: dict[str, float] = {}  # worker -> when it last flipped
        self._refused: set[tuple[str, Role]] = set()  # (worker, role) it cannot take

    def decide(
        self,
        now_s: float,
        pressure: RolePressure,
        num_prefill: int,
        num_decode: int,
        num_mixed: int = 0,
        num_encode: int = 0,
    ) -> Flip:
        if now_s - self._last_flip_s < self.interval_s:
            return Flip.NONE
        flip = Flip.NONE
        if num_encode:
            worst_pd = max(pressure.prefill, pressure.decode)
            flip = self._encode_flip(pressure, num_prefill, num_encode, worst_pd)
        if flip is Flip.NONE and num_mixed:
            flip = self._from_mixed(pressure, num_prefill, num_decode, num_mixed)
        elif flip is Flip.NONE:
            flip = self._between_pools(pressure, num_prefill, num_decode)
        if flip is Flip.NONE:
            flip = self._to_mixed(pressure, num_prefill, num_decode, num_mixed)
        if flip is Flip.NONE:
            return flip
        if _REVERSE[flip] is self._last_flip and now_s - self._last_flip_s < self.min_dwell_s:
            return Flip.NONE
        self._before_last = (self._last_flip_s, self._last_flip)
        self._last_flip_s = now_s
        self._last_flip = flip
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

    def may_flip(self, worker_id: str, now_s: float) -> bool:
        """Past its minimum dwell in the role it has."""
        return now_s - self._flipped_s.get(worker_id, -math.inf) >= self.min_dwell_s

    def record_flip(self, worker_id: str, now_s: float) -> None:
        self._flipped_s[worker_id] = now_s

    def may_take(self, worker_id: str, role: Role) -> bool:
        """The worker has not refused ``role`` (a fixed-role worker, an engine that
        cannot encode)."""
        return (worker_id, role) not in self._refused

    def refused(self, worker_id: str, role: Role) -> None:
        """The applier could not flip ``worker_id`` to ``role``: it kept its role. The
        flip is taken back (no interval, dwell or reversal counts from it) and the
        worker is never chosen for that role again."""
        self._refused.add((worker_id, role))
        self._flipped_s.pop(worker_id, None)
        self.withdraw()

    def withdraw(self) -> None:
        """The last decision was not carried out: it counts for nothing."""
        self._last_flip_s, self._last_flip = self._before_last

    def _between_pools(self, pressure: RolePressure, num_prefill: int, num_decode: int) -> Flip:
        p, d = pressure.prefill, pressure.decode
        worst = max(p, d)
        if num_decode > 1 and p > d:
            after = max(p * num_prefill / (num_prefill + 1), d * num_decode / (num_decode - 1))
            if after < worst - self.hysteresis:
                return Flip.DECODE_TO_PREFILL
        elif num_prefill > 1 and d > p:
            after = max(d * num_decode / (num_decode + 1), p * num_prefill / (num_prefill - 1))
            if after < worst - self.hysteresis:
                return Flip.PREFILL_TO_DECODE
        return Flip.NONE

    def _to_mixed(
        self, pressure: RolePressure, num_prefill: int, num_decode: int, num_mixed: int
    ) -> Flip:
        """Pool the load when a dedicated flip cannot help: a role has one worker (or
        none) left, so the pressed role cannot take a dedicated worker from it."""
        if min(num_prefill, num_decode) > 1:
            return Flip.NONE
        pools = [(pressure.prefill, num_prefill, Flip.PREFILL_TO_MIXED)]
        pools.append((pressure.decode, num_decode, Flip.DECODE_TO_MIXED))
        if num_mixed:
            if pressure.mixed_tpot > 1.0:
                return Flip.NONE  # their decodes have no room for more prefill chunks
            pools.append((pressure.mixed, num_mixed, Flip.NONE))
        present = [(x, n, f) for x, n, f in pools if n > 0]
        total = sum(n for _, n, _ in present)
        if total < 2:
            return Flip.NONE
        worst = max(x for x, _, _ in present)
        pooled = sum(x * n for x, n, _ in present) / total
        if pooled >= worst - self.hysteresis:
            return Flip.NONE
        # The least pressed dedicated role gives a worker (it helps the pressed one first).
        dedicated = [(x, f) for x, n, f in present if f is not Flip.NONE]
        return min(dedicated, key=lambda xf: xf[0])[1] if dedicated else Flip.NONE

    def _from_mixed(
        self, pressure: RolePressure, num_prefill: int, num_decode: int, num_mixed: int
    ) -> Flip:
        """Mixed workers missing TPOT (chunked prefills stall their decodes): give a
        dedicated pool one back. A TTFT miss never unpools: the router already spreads
        prompts over every worker that prefills, and a dedicated worker prefills no
        faster (to decode it prefills nothing). Live (CI), a 2-mixed pair went back to
        1 prefill + 1 decode in the middle of a prefill-heavy phase and served fewer of
        its long prompts than the split that never pooled; a TPOT miss there is cured
        at the cost of TTFT, so it unpools only when TTFT can take it."""
        m = pressure.mixed_tpot
        if m <= 1.0 + self.hysteresis:
            return Flip.NONE
        if num_prefill and pressure.prefill >= m - self.hysteresis:
            return Flip.NONE  # the dedicated pools are as pressed: nothing gained
        if num_decode and pressure.decode >= m - self.hysteresis:
            return Flip.NONE
        others = num_mixed - 1
        if num_prefill + others > 0:
            # To decode, if the prompts' TTFT, pooled over one prefilling worker fewer,
            # stays below the TPOT miss it cures.
            prefilling = num_prefill + num_mixed
            load = pressure.prefill * num_prefill + pressure.mixed_ttft * num_mixed
            after = load / (prefilling - 1)
            return Flip.MIXED_TO_DECODE if after < m - self.hysteresis else Flip.NONE
        # The last worker that prefills: it keeps prefilling, its decodes go to the
        # decode pool (which has room: above).
        return Flip.MIXED_TO_PREFILL if num_decode else Flip.NONE


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
    Flip.PREFILL_TO_MIXED: (Role.PREFILL, Role.MIXED),
    Flip.DECODE_TO_MIXED: (Role.DECODE, Role.MIXED),
    Flip.MIXED_TO_PREFILL: (Role.MIXED, Role.PREFILL),
    Flip.MIXED_TO_DECODE: (Role.MIXED, Role.DECODE),
}


def choose_flip(
    view: ClusterView, pressure: RolePressure, planner: RatioPlanner, now_s: float
) -> RoleFlip | None:
    """The planner's decision as the worker to flip: the least busy of the role that
    gives one up, past its minimum dwell and not known to refuse the new role (draining
    workers are not counted). The gateway's rebalancer and the simulator both apply
    this; a decision no worker can carry out counts for nothing."""
    roles = (Role.PREFILL, Role.DECODE, Role.MIXED, Role.ENCODE)
    pools = {role: view.by_role(role) for role in roles}
    flip = planner.decide(
        now_s,
        pressure,
        len(pools[Role.PREFILL]),
        len(pools[Role.DECODE]),
        num_mixed=len(pools[Role.MIXED]),
        num_encode=len(pools[Role.ENCODE]),
    )
    if flip is Flip.NONE:
        return None
    source, target = _FLIPS[flip]
    eligible = [
        w
        for w in pools[source]
        if planner.may_flip(w.worker_id, now_s) and planner.may_take(w.worker_id, target)
    ]
    if not eligible:
        planner.withdraw()
        return None
    worker = min(eligible, key=_busyness)
    planner.record_flip(worker.worker_id, now_s)
    return RoleFlip(worker.worker_id, source, target)


def _busyness(w: WorkerView) -> tuple[int, int]:
    return len(w.running), sum(w.queued_tokens.values())
