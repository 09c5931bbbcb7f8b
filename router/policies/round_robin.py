"""``round_robin``: cycle prefill and decode workers; the baseline every other policy beats."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.policy import register_policy
from router.types import ClusterView, Plan, Reject, RequestProfile, Role

__all__ = ["RoundRobin"]


@register_policy("round_robin")
@dataclass
class RoundRobin:
    """Cycle prefill and decode workers independently; colocate when none is split by role."""

    name: str = "round_robin"
    _next_prefill: int = field(default=0, repr=False)
    _next_decode: int = field(default=0, repr=False)

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        prefill = view.by_role(Role.PREFILL)
        decode = view.by_role(Role.DECODE)
        if prefill and decode:
            p = prefill[self._next_prefill % len(prefill)]
            d = decode[self._next_decode % len(decode)]
            self._next_prefill += 1
            self._next_decode += 1
            return Plan(prefill_worker=p.worker_id, decode_worker=d.worker_id)
        mixed = view.by_role(Role.MIXED) or prefill or decode
        if not mixed:
            return Reject("no live worker", retry_after_s=1.0)
        w = mixed[self._next_prefill % len(mixed)]
        self._next_prefill += 1
        return Plan(prefill_worker=w.worker_id, decode_worker=None)
