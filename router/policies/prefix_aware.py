"""``prefix_aware``: send a prompt to the prefill worker that caches the longest prefix of it.

Affinity is the number of leading ``profile.prefix_hashes`` found in a worker's
``prefix_digest``. A load guard keeps affinity from piling work on one worker:
when the best-matching worker's queued tokens exceed
``guard_factor × (least queued) + guard_slack_tokens``, the request goes to the
least-loaded worker instead. Decode is least loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.policies.least_loaded import decode_load, prefill_load
from router.policy import register_policy
from router.prefix_index import PrefixIndex
from router.types import ClusterView, Plan, Reject, RequestProfile, Role, WorkerView

__all__ = ["PrefixAware"]


@register_policy("prefix_aware")
@dataclass
class PrefixAware:
    name: str = "prefix_aware"
    guard_factor: float = 2.0
    guard_slack_tokens: int = 4096
    _workers: tuple[WorkerView, ...] | None = field(default=None, init=False, repr=False)
    _index: PrefixIndex = field(default_factory=PrefixIndex, init=False, repr=False)

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        self._sync(view.workers)
        prefill = view.by_role(Role.PREFILL)
        decode = view.by_role(Role.DECODE)
        split = bool(prefill and decode)
        hosts = prefill if split else (view.by_role(Role.MIXED) or prefill or decode)
        if not hosts:
            return Reject("no live worker", retry_after_s=1.0)
        host = self._prefill_host(profile, view, hosts)
        if not split:
            return Plan(prefill_worker=host.worker_id, decode_worker=None)
        d = min(decode, key=decode_load)
        return Plan(prefill_worker=host.worker_id, decode_worker=d.worker_id)

    def _prefill_host(
        self, profile: RequestProfile, view: ClusterView, hosts: tuple[WorkerView, ...]
    ) -> WorkerView:
        least = min(hosts, key=prefill_load)
        matched = self._index.matched_blocks(profile.prefix_hashes)
        eligible = {w.worker_id for w in hosts}
        best: WorkerView | None = None
        best_key: tuple[int, int] = (0, 0)
        for i, blocks in matched.items():
            w = view.workers[i]
            if w.worker_id not in eligible:
                continue
            key = (blocks, -prefill_load(w))
            if best is None or key > best_key:
                best, best_key = w, key
        if best is None:
            return least
        limit = self.guard_factor * prefill_load(least) + self.guard_slack_tokens
        return best if prefill_load(best) <= limit else least

    def _sync(self, workers: tuple[WorkerView, ...]) -> None:
        old = self._workers
        if workers is old:
            return
        if old is None or len(old) != len(workers):
            self._index.reset([w.prefix_digest for w in workers])
        else:
            for i, (new_w, old_w) in enumerate(zip(workers, old)):
                if new_w is not old_w:
                    self._index.update(i, new_w.prefix_digest)
        self._workers = workers
