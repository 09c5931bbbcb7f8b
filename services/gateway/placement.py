"""Placing a request: router decisions, the hold line, and refusals as 429s.

place     one router decision (``Router.place``); a plan whose worker has left
          meanwhile counts as a hold
hold      a held request waits in its length class's hold line (hold_line.py)
          until it is placed, refused, or out of ``max_hold_s`` or its TTFT budget;
          a re-placed one (its stream has started) skips the line and waits up to
          ``replace_hold_s`` for room, never refused for its age
refuse    a ``Reject``, or a hold that ran out, is an ``Overloaded`` (429 with
          ``Retry-After``) counted in ``baton_router_rejections_total``
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.front_door import Hold, Router
from router.length import effective_prefill_tokens
from router.types import LengthClass, Plan, Reject, RequestProfile
from services.gateway.errors import Overloaded
from services.gateway.hold_line import HoldLine
from services.metrics import BatonMetrics
from services.workers.client import WorkerClient

__all__ = ["HoldSettings", "Placer", "unreserve"]


@dataclass(frozen=True, slots=True)
class HoldSettings:
    max_hold_s: float = 5.0
    hold_poll_s: float = 0.01
    # How long a re-placed request (its stream already started) waits for room; it is
    # never refused for its age, only when no worker could take it in this long.
    replace_hold_s: float = 60.0


class Placer:
    def __init__(
        self,
        router: Router,
        clients: Callable[[str], WorkerClient | None],
        metrics: BatonMetrics,
        settings: HoldSettings,
    ) -> None:
        self._router = router
        self._clients = clients
        self._metrics = metrics
        self._settings = settings
        # One line per length class: a short request waits only behind held short ones.
        # Held long prompts wait for room that a short one does not take (the spatial
        # split's other pool, or the temporal split's short-first queue); in one line,
        # live on 2 slow cores, long prompts held for a one-worker long pool made every
        # short request behind them "too many requests held ahead" (429).
        self.lines = {length_class: HoldLine() for length_class in LengthClass}

    async def place(self, profile: RequestProfile, *, replaced: bool = False) -> Plan:
        """A plan for ``profile``. A held request waits in the hold line (hold_line.py)
        until ``max_hold_s``; a re-placed one (``replaced``: its stream has started)
        skips the line and holds on any rejection until room appears
        (``replace_hold_s``)."""
        if replaced:
            return await self._place_replaced(profile)
        deadline_s = time.monotonic() + self._settings.max_hold_s
        # Seen by the router whether it is placed now, waits behind others or is
        # refused behind them: the length classes' shares count every arrival.
        self._router.arrive(profile)
        line = self.line_of(profile)
        rid = profile.request_id
        if len(line):
            self._refuse_behind(line, profile)  # raises when the line is too slow for it
            decision: Plan | Hold | Reject = Hold("waiting behind held requests", 1.0)
        else:
            decision = self._try_place(profile, replaced=False)
            if isinstance(decision, Plan):
                return decision
            if isinstance(decision, Reject) or time.monotonic() >= deadline_s:
                raise self._refusal(profile, decision)
        line.join(rid, time.monotonic())
        try:
            # Behind others, no longer than its TTFT budget lasts: past it, no place helps.
            if not await line.wait_turn(rid, self._budget_s(profile, time.monotonic())):
                raise self._refusal(profile, decision)
            while True:
                decision = self._try_place(profile, replaced=False)
                if isinstance(decision, Plan):
                    return decision
                if isinstance(decision, Reject) or time.monotonic() >= deadline_s:
                    raise self._refusal(profile, decision)
                await asyncio.sleep(self._settings.hold_poll_s)
        finally:
            line.leave(rid, time.monotonic())

    async def _place_replaced(self, profile: RequestProfile) -> Plan:
        deadline_s = time.monotonic() + self._settings.replace_hold_s
        while True:
            decision = self._try_place(profile, replaced=True)
            if isinstance(decision, Plan):
                return decision
            if time.monotonic() >= deadline_s:
                raise self._refusal(profile, decision)
            await asyncio.sleep(self._settings.hold_poll_s)

    def line_of(self, profile: RequestProfile) -> HoldLine:
        """The hold line of the request's length class, by the router's θ."""
        tokens = effective_prefill_tokens(profile)
        return self.lines[self._router.classifier.classify(tokens)]

    def _try_place(self, profile: RequestProfile, *, replaced: bool) -> Plan | Hold | Reject:
        """One router decision; a plan whose worker left meanwhile counts as a hold."""
        router = self._router
        now_s = time.monotonic()
        decision = router.place(profile, now_s, replaced=replaced)
        self._metrics.decision_s.labels(router.settings.policy).observe(time.monotonic() - now_s)
        if isinstance(decision, Plan) and not self._plan_is_live(decision):
            unreserve(router, profile.request_id, decision)
            return Hold("a planned worker left", self._settings.hold_poll_s)
        return decision

    def _budget_s(self, profile: RequestProfile, now_s: float) -> float:
        """How much longer ``profile`` may wait for a place: the hold limit, and what is
        left of its TTFT target."""
        waited_s = max(0.0, now_s - profile.arrival_s)
        budget_s = self._settings.max_hold_s - waited_s
        ttft_s = profile.slo.ttft_s or self._router.settings.default_slo.ttft_s
        return budget_s if ttft_s is None else min(budget_s, ttft_s - waited_s)

    def _refuse_behind(self, line: HoldLine, profile: RequestProfile) -> None:
        """Refuse at once a request that would wait out its time behind the line."""
        now_s = time.monotonic()
        wait_s = line.expected_wait_s(now_s)
        if wait_s is not None and wait_s > self._budget_s(profile, now_s):
            ahead = Reject("too many requests held ahead", retry_after_s=max(1.0, wait_s))
            raise self._refusal(profile, ahead)

    def _refusal(self, profile: RequestProfile, decision: Plan | Hold | Reject) -> Overloaded:
        match decision:
            case Plan():
                return Overloaded("the planned workers are gone", 1.0)
            case Hold(reason=reason, retry_after_s=retry_after_s):
                retryable = True
            case Reject(reason=reason, retry_after_s=retry_after_s, retryable=retryable):
                pass
        self._metrics.rejections.labels(reason, profile.priority.value).inc()
        return Overloaded(f"request rejected: {reason}", retry_after_s, should_retry=retryable)

    def _plan_is_live(self, plan: Plan) -> bool:
        names = [plan.prefill_worker, plan.decode_worker, *plan.encode_workers]
        return all(self._clients(n) is not None for n in names if n is not None)


def unreserve(router: Router, placed_id: str, plan: Plan, keep: str | None = None) -> None:
    """Drop the plan's reservations on its workers, but ``keep``'s."""
    for worker_id in plan.text_workers:
        if worker_id != keep:
            router.unreserve(placed_id, worker_id)
