"""``Router``: the one front door the gateway and the simulator drive.

It owns everything around ``policy.plan`` that used to exist once per caller:

* the **settings**, frozen once (``RouterSettings``, router/settings.py: seconds and defaults applied);
* the **cluster view** (``live``, a ``router.live_view.LiveView``), kept
  incrementally: ``update(report)`` rebuilds only that worker's ``WorkerView`` and the
  other workers keep their objects, so the policy's per-worker caches
  (``WorkerTable.sync`` compares by identity) recompute one row;
* the **reservations**: a placed plan is added to its workers' views until each
  worker's telemetry counts it (``router.reservations``: a worker's first event,
  ``release(id, worker)``, ends what was queued there; what runs there stays until the
  worker's next report) or the request ends (``release(id)``);
* the **one length classifier**: queued prompts are classified by its θ, and θ is
  observed once per request (at ``arrive``, or the first ``place`` of a request id),
  not once per re-plan of a held request;
* **hold or reject**: a policy's ``Reject(hold=True)`` comes back as ``Hold``;
* the **links**: ``observe_transfer`` fits each worker's KV link (``router.links``);
* the **ratio planner's inputs**: ``pressure()`` (the policy's role pressure at the
  mean prompt length of the requests placed, each counted once).

Call order, per request: ``arrive`` (optional: ``place`` does it) -> ``place`` (again
after each ``Hold``) -> ``release(id, worker)`` at each worker's first event for it ->
``release(id)`` when it ends however it ends; ``observe_transfer`` and
``observe_outcome`` as they happen.

Pure like the rest of ``router``: no Ray, HTTP, torch or clock reads; ``now_s`` is
passed in. A worker report is anything shaped like ``services.workers.messages.
WorkerSnapshot`` (``WorkerReport`` below), so this module imports nothing of services.

Learning from outcomes: ``observe_outcome`` is the one place where a finished
request's output length (the KV estimator's history) and its measured TTFT/TPOT against
its plan's predictions (``router.correction.Outcome``) reach the router; the latter
correct each worker's predictions, and ``router.admission`` refuses at ``place`` what
the corrected predictions say will miss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from router import live_speed
from router.admission import Admission
from router.correction import Outcome, OutcomeCorrector
from router.image_parts import split_images
from router.length import LengthClassifier, effective_prefill_tokens
from router.links import Links
from router.live_view import LiveView
from router.planner import RatioPlanner, RoleFlip, RolePressure, choose_flip
from router.policy import Policy, make_policy_from_settings
from router.profile import TransferCoeffs
from router.refusals import RefusalMeter
from router.reservations import Reservations
from router.settings import RouterSettings
from router.types import (
    ClusterView,
    Plan,
    Reject,
    RequestProfile,
    Role,
    WorkerReport,
)

__all__ = ["Hold", "Router", "RouterSettings", "WorkerReport"]

_PROMPT_EMA_WEIGHT = 0.05  # the mean prompt length the ratio planner sizes prefill by


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the request at the front door and ``place`` it again after ``retry_after_s``."""

    reason: str
    retry_after_s: float


class Router:
    def __init__(self, settings: RouterSettings, policy: Policy | None = None) -> None:
        self.settings = settings
        self.classifier = LengthClassifier(
            settings.profile.prefill, settings.length_threshold_tokens
        )
        self.policy = policy or make_policy_from_settings(
            settings.policy, settings.policy_options(self.classifier)
        )
        self._reservations = Reservations()
        self._observed: set[str] = set()  # request ids whose length θ has seen
        self._links = Links(settings.profile.transfer)
        self.live = LiveView(self._reservations, self._links, self.classifier)
        self._planner = RatioPlanner(interval_s=settings.rebalance_interval_s)
        self.mean_prompt_tokens = 0.0
        self.corrector = OutcomeCorrector(settings.correction)
        self.refusals = RefusalMeter(window_s=settings.rebalance_interval_s)
        self.admission = Admission(settings.admission, self.corrector)

    # -- telemetry ---------------------------------------------------------------------
    def update(self, report: WorkerReport) -> None:
        """Take a worker's snapshot; only that worker's view is rebuilt (lazily)."""
        before = self.live.report(report.worker_id)
        if self.live.update(report) and before is not None and before.role != report.role:
            self.admission.forget(report.worker_id)  # its predictions are a new role's now

    def mark_dead(self, worker_id: str) -> None:
        self.live.mark_dead(worker_id)
        for wid in self._reservations.drop_worker(worker_id):
            self.live.invalidate(wid)
        self._links.forget(worker_id)
        self.admission.forget(worker_id)

    def revive(self, worker_id: str) -> None:
        """A new worker under an id marked dead (a control plane started anew reuses its
        workers' ids): its reports count again."""
        self.live.revive(worker_id)

    def is_alive(self, worker_id: str) -> bool:
        return self.live.is_alive(worker_id)

    def reports(self) -> dict[str, WorkerReport]:
        return self.live.reports()

    def has_workers(self) -> bool:
        """Whether any live worker has reported (asked on every request: no copy)."""
        return self.live.has_workers()

    def observe_outcome(self, output_len: int, outcome: Outcome | None = None) -> None:
        """A finished request's output length (the history H of the KV estimator, which
        the view shows ``_PUBLISH_OUTPUT_LENS_EVERY`` lengths at a time, the first at
        once) and, if measured, its TTFT/TPOT against its plan's predictions (the
        corrections that admission prices plans with)."""
        if outcome is not None:
            self.corrector.observe(outcome)
            self.admission.observe(outcome)
        self.live.observe_output_len(output_len)

    # -- deciding ----------------------------------------------------------------------
    def view(self) -> ClusterView:
        """The cluster as the policy sees it: telemetry plus reservations."""
        return self.live.view()

    def arrive(self, profile: RequestProfile) -> None:
        """A request reached the front door: θ, the length classes' shares and the mean
        prompt length see it now, once (``place`` does this for a request it has not
        seen). A gateway that makes a request wait behind held ones of its class, or
        refuses it there, before any ``place``, calls this first: unobserved, the
        arrivals of a class held for a busy pool looked like a class that stopped
        coming, and a class judged gone gives up its spatial pool, so its held prompts
        went to the other class's workers (live, 2 prefill + 2 decode)."""
        if profile.request_id not in self._observed:
            self._observed.add(profile.request_id)
            self._observe_request(profile, self.view())

    def place(
        self, profile: RequestProfile, now_s: float, *, replaced: bool = False
    ) -> Plan | Hold | Reject:
        """Plan ``profile``; a plan is reserved on its workers until ``release``.

        ``replaced``: a failover re-placement; its age is not held against it (the
        TTFT budget counts from now) and its length is not observed again."""
        view = self.view()
        if replaced:
            profile = dataclasses.replace(profile, arrival_s=now_s)
        else:
            self.arrive(profile)
        decision = self.policy.plan(profile, view, now_s)
        if isinstance(decision, Reject):
            if decision.hold:
                return Hold(decision.reason, decision.retry_after_s)
            self._observed.discard(profile.request_id)
            if decision.retryable:  # a hopeless request (too long for any worker) says
                self.refusals.refused(now_s, decision.reason)  # nothing of the roles' mix
            return decision
        if profile.num_images and not hasattr(self.policy, "observe_encode"):
            decision = _with_encode_worker(decision, view, profile.tokens_per_image())
        if not replaced:  # a re-placement continues a started stream: never refused here
            waited_s = self.pending_age_s(decision.prefill_worker, now_s)
            decode = decision.decode_worker or decision.prefill_worker
            refusal = self.admission.judge(
                profile,
                decision,
                now_s,
                self.settings.default_slo,
                waited_s,
                self.recent_step_s(decode),
                self.recent_slowdown(decode),
                self.recent_slowdown(decision.prefill_worker, prefill=True),
                live_speed.shared_step_deadline_s(
                    self.live.report(decision.prefill_worker),
                    self._reservations,
                    decision.prefill_worker,
                ),
            )
            if refusal is not None:
                self._observed.discard(profile.request_id)
                self.refusals.refused(now_s, refusal.reason)
                return refusal
            self.refusals.placed(now_s)
        # Observed until ``release(id)``: a re-place is not new.
        self.reserve(profile, decision, now_s)
        return decision

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        """``worker_id``'s first event for the request: what it queued there goes, and
        where it runs there, the rest goes with that worker's next report, which counts
        it (``router.reservations``). No ``worker_id``: the request finished, failed or
        gave up waiting; drop all of it (and, if it was held, its place)."""
        if worker_id is None:
            self._observed.discard(request_id)
            changed = self._reservations.drop(request_id)
        else:
            report = self.live.report(worker_id)
            seq = None if report is None else report.seq
            changed = self._reservations.start(request_id, worker_id, seq)
        for wid in changed:
            self.live.invalidate(wid)

    def unreserve(self, request_id: str, worker_id: str) -> None:
        """The request will not run on ``worker_id`` (its plan was abandoned there): its
        part of the reservation goes now, whatever it was."""
        for wid in self._reservations.drop(request_id, worker_id):
            self.live.invalidate(wid)

    def observe_transfer(
        self, prefill_worker: str, decode_worker: str, num_bytes: int, duration_s: float
    ) -> None:
        """A KV pull from ``prefill_worker`` to ``decode_worker`` finished: both ends'
        links are refitted (a pair is priced by its slower end)."""
        for wid in (prefill_worker, decode_worker):
            if self._links.observe(wid, num_bytes, duration_s):
                self.live.invalidate(wid)

    def observe_encode(self, worker_id: str, num_image_tokens: int, duration_s: float) -> None:
        """An encode on ``worker_id`` took ``duration_s`` (worker clock): for a policy
        that prices encodes (``observe_encode``), the encode term is refitted."""
        observe = getattr(self.policy, "observe_encode", None)
        if callable(observe):
            observe(worker_id, num_image_tokens, duration_s)

    def link(self, worker_id: str) -> TransferCoeffs:
        """The worker's link as measured (the profile's until a transfer is seen)."""
        return self._links.estimate(worker_id)

    def pressure(self, now_s: float | None = None) -> RolePressure | None:
        """Each role's load for the ratio planner; None if the policy cannot tell."""
        if not callable(getattr(self.policy, "pressure", None)):
            return None
        return self.role_pressure(self.view(), self.mean_prompt_tokens, now_s)

    def role_pressure(
        self, view: ClusterView, mean_prompt_tokens: float, now_s: float | None = None
    ) -> RolePressure:
        """The policy's pressure on ``view``, raised by what was refused for each role
        lately (``router.refusals``, up to ``now_s``): the overload admission keeps out
        of the queues."""
        result: RolePressure = self.policy.pressure(view, mean_prompt_tokens)  # type: ignore[attr-defined]
        return self.refusals.raise_pressure(result, now_s)

    def plan_flip(self, now_s: float) -> RoleFlip | None:
        """The P/D ratio planner's decision for this interval (the simulator applies it;
        the gateway's ``Rebalancer`` makes the same one with ``choose_flip``)."""
        pressure = self.pressure(now_s)
        return (
            None if pressure is None else choose_flip(self.view(), pressure, self._planner, now_s)
        )

    def pending_age_s(self, worker_id: str, now_s: float) -> float:
        """How long the oldest request placed to prefill on ``worker_id`` has waited
        without its first event (``router.live_speed.pending_age_s``)."""
        return live_speed.pending_age_s(self._reservations, worker_id, now_s)

    def recent_step_s(self, worker_id: str) -> float:
        """The decode worker's speed as it is now (``router.live_speed.recent_step_s``)."""
        return live_speed.recent_step_s(self.live.report(worker_id), self._reservations, worker_id)

    def recent_slowdown(self, worker_id: str, *, prefill: bool = False) -> live_speed.Slowdown:
        """How ``worker_id``'s last few steps ran against its model while it has work
        (``router.live_speed.recent_slowdown``)."""
        cost_model = getattr(self.policy, "cost_model", None)
        return live_speed.recent_slowdown(
            self.live.report(worker_id),
            self._reservations,
            worker_id,
            cost_model if callable(cost_model) else None,
            prefill=prefill,
        )

    def block_size(self) -> int | None:
        """The KV block size prompts are hashed by for prefix matching (the smallest)."""
        return self.live.block_size()

    def num_reservations(self) -> int:
        return len(self._reservations)

    def use_policy(self, name: str) -> None:
        """Place with the policy ``name`` from now on (same settings, view, reservations
        and θ); placed requests are unaffected."""
        self.settings = dataclasses.replace(self.settings, policy=name)
        self.policy = make_policy_from_settings(name, self.settings.policy_options(self.classifier))

    # -- internals ---------------------------------------------------------------------
    def _observe_request(self, profile: RequestProfile, view: ClusterView) -> None:
        """Once per request: θ and the mean prompt length move with new traffic only.
        θ and the length classes' shares of the work see what the request will prefill
        where its prefix is cached (a policy that matches prefixes says:
        ``least_prefill_tokens``), as the classes it is placed by do: a conversation's
        later turns are long prompts, mostly cached. Counted whole, they made the
        spatial split's LONG pool a third of the workers, which the turns, short where
        their prefix is, never used (``benchmarks/policies.py`` multi_turn, 16 GPUs
        all mixed: 715 req/s against 882 with the temporal split)."""
        least = getattr(self.policy, "least_prefill_tokens", None)
        tokens = least(profile, view) if callable(least) else effective_prefill_tokens(profile)
        self.classifier.observe(tokens)
        n = profile.num_prompt_tokens + profile.num_image_tokens
        m = self.mean_prompt_tokens
        self.mean_prompt_tokens = n if m == 0 else m + _PROMPT_EMA_WEIGHT * (n - m)

    def reserve(self, profile: RequestProfile, plan: Plan, placed_s: float | None = None) -> None:
        """Hold what ``plan`` will take on its workers until ``release`` (``place`` does
        this for its plans, at ``placed_s``; for a plan made elsewhere, e.g. an operator
        pinning)."""
        report = self.live.report(plan.prefill_worker)
        changed = self._reservations.add(
            profile,
            plan,
            self.classifier.classify,
            placed_s,
            None if report is None else report.seq,
            self.admission.ttft_deadline_s(profile, self.settings.default_slo),
        )
        for wid in changed:
            self.live.invalidate(wid)


def _with_encode_worker(plan: Plan, view: ClusterView, tokens: tuple[float, ...]) -> Plan:
    """For a policy that does not price encodes: the request's images spread over the
    encode workers with the fewest queued image tokens, one part per worker, if there
    are any (an operator who started encode workers wants images encoded there)."""
    encoders = view.by_role(Role.ENCODE)
    if not encoders or plan.encode_worker is not None:
        return plan
    ranked = sorted(encoders, key=lambda w: sum(w.queued_tokens.values()))
    parts = split_images(tokens, tuple(w.worker_id for w in ranked))
    split = parts if len(parts) > 1 else ()
    return dataclasses.replace(plan, encode_worker=parts[0][0], encode_parts=split)
