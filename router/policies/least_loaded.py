"""``least_loaded``: the prefill worker with the fewest queued tokens, the decode worker
with the smallest share of its KV blocks in use; colocated when roles are not split."""

from __future__ import annotations

from dataclasses import dataclass

from router.policy import register_policy
from router.types import ClusterView, Plan, Reject, RequestProfile, Role, WorkerView

__all__ = ["LeastLoaded", "decode_load", "prefill_load"]


def prefill_load(w: WorkerView) -> int:
    return sum(w.queued_tokens.values())


def decode_load(w: WorkerView) -> tuple[float, int]:
    used = 1.0 - w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 0.0
    return used, len(w.running)


@register_policy("least_loaded")
@dataclass
class LeastLoaded:
    name: str = "least_loaded"

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        prefill = view.by_role(Role.PREFILL)
        decode = view.by_role(Role.DECODE)
        if prefill and decode:
            p = min(prefill, key=prefill_load)
            d = min(decode, key=decode_load)
            return Plan(prefill_worker=p.worker_id, decode_worker=d.worker_id)
        hosts = view.by_role(Role.MIXED) or prefill or decode
        if not hosts:
            return Reject("no live worker", retry_after_s=1.0)
        w = min(hosts, key=lambda h: (decode_load(h), prefill_load(h)))
        return Plan(prefill_worker=w.worker_id, decode_worker=None)
