"""``Router``: the one front door the gateway and the simulator drive.

It owns everything around ``policy.plan`` that used to exist once per caller:

* the **settings**, frozen once (``RouterSettings``, router/settings.py: seconds and defaults applied);
* the **cluster view**, kept incrementally: ``update(report)`` rebuilds only that
  worker's ``WorkerView`` and the other workers keep their objects, so the policy's
  per-worker caches (``WorkerTable.sync`` compares by identity) recompute one row;
* the **reservations**: a placed plan is added to its workers' views until
  ``release(plan)`` (the gateway releases when the worker's telemetry counts it);
* the **one length classifier**: queued prompts are classified by its θ, and θ is
  observed once per request (the first ``place`` of a request id), not once per
  re-plan of a held request;
* **hold or reject**: a policy's ``Reject(hold=True)`` comes back as ``Hold``;
* the **links**: ``observe_transfer`` fits each worker's KV link (``router.links``);
* the **ratio planner's inputs**: ``pressure()`` (the policy's role pressure at the
  mean prompt length of the requests placed, each counted once).

Call order, per request: ``place`` (again after each ``Hold``) -> ``release(id,
worker)`` as each worker's telemetry starts counting it -> ``release(id)`` when it
ends however it ends; ``observe_transfer`` and ``observe_outcome`` as they happen.

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
import math
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from router.admission import Admission
from router.correction import Outcome, OutcomeCorrector
from router.cost_model import TransferCoeffs
from router.length import LengthClassifier, effective_prefill_tokens
from router.links import LinkFit
from router.planner import RatioPlanner, RoleFlip, RolePressure, choose_flip
from router.policy import Policy, make_policy_from_settings
from router.refusals import RefusalMeter
from router.settings import RouterSettings
from router.types import (
    ClusterView,
    LengthClass,
    Plan,
    Reject,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
    WorkerView,
    split_images,
)

__all__ = ["Hold", "Router", "RouterSettings", "WorkerReport"]

_OUTPUT_HISTORY = 256
_PROMPT_EMA_WEIGHT = 0.05  # the mean prompt length the ratio planner sizes prefill by
# A link's figures reach the view only when they moved this much: each transfer nudges
# the fit, and rebuilding both ends' rows for every nudge would double the view's work.
_LINK_TOLERANCE = 0.05
_RECENT_STEPS = 3  # decode steps whose median is the worker's speed now


class WorkerReport(Protocol):
    """What ``Router.update`` reads of a worker's telemetry (``WorkerSnapshot`` has it)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> Role: ...
    @property
    def draining(self) -> bool: ...
    @property
    def seq(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def running(self) -> tuple[RunningRequest, ...]: ...
    @property
    def waiting_prompt_lens(self) -> tuple[int, ...]: ...
    @property
    def recent_steps(self) -> tuple[StepSample, ...]: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def prefix_digest(self) -> tuple[int, ...]: ...
    @property
    def prefill_budget_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Hold:
    """Keep the request at the front door and ``place`` it again after ``retry_after_s``."""

    reason: str
    retry_after_s: float


@dataclass(slots=True)
class _Reservation:
    plan: Plan
    workers: set[str]  # the plan's workers whose telemetry does not count it yet
    prefill_tokens: int
    length_class: LengthClass
    held_tokens: int
    max_tokens: int
    placed_s: float | None = None  # when ``place`` made it (None: reserved from outside)
    image_tokens: int = 0  # queued on the plan's encode worker until its first event
    # Split over several encode workers: each one's share of ``image_tokens``.
    encode_tokens: dict[str, int] | None = None
    # Its row in the decode worker's running set, one object for its lifetime: the
    # policy keeps a request's memory-estimate draws while the same object runs there.
    running: RunningRequest | None = None


@dataclass(slots=True)
class _Worker:
    report: WorkerReport
    digest: frozenset[int]
    view: WorkerView | None = None  # the last one built


class Router:
    def __init__(self, settings: RouterSettings, policy: Policy | None = None) -> None:
        self.settings = settings
        self.classifier = LengthClassifier(
            settings.profile.prefill, settings.length_threshold_tokens
        )
        self.policy = policy or make_policy_from_settings(
            settings.policy, settings.policy_options(self.classifier)
        )
        self._workers: dict[str, _Worker] = {}
        self._dead: set[str] = set()
        self._reservations: dict[str, _Reservation] = {}  # request id -> what it took
        # worker id -> reserving request ids, oldest first (a dict keeps insertion order)
        self._by_worker: dict[str, dict[str, None]] = {}
        self._observed: set[str] = set()  # request ids whose length θ has seen
        self._output_lens: deque[int] = deque(maxlen=_OUTPUT_HISTORY)
        self._output_tuple: tuple[int, ...] = ()
        self._view: ClusterView | None = None
        # The view's workers in order; None: a worker joined or left, rebuild the order.
        self._slots: list[WorkerView] | None = None
        self._index: dict[str, int] = {}
        self._stale: set[str] = set()  # workers whose view must be rebuilt
        self._links: dict[str, LinkFit] = {}
        self._published_links: dict[str, TransferCoeffs] = {}  # what the view shows
        self._planner = RatioPlanner(interval_s=settings.rebalance_interval_s)
        self.mean_prompt_tokens = 0.0
        self.corrector = OutcomeCorrector(settings.correction)
        self.refusals = RefusalMeter(window_s=settings.rebalance_interval_s)
        self.admission = Admission(settings.admission, self.corrector)

    # -- telemetry ---------------------------------------------------------------------
    def update(self, report: WorkerReport) -> None:
        """Take a worker's snapshot; only that worker's view is rebuilt (lazily)."""
        wid = report.worker_id
        if wid in self._dead:
            return
        known = self._workers.get(wid)
        if known is not None and report.seq <= known.report.seq:
            return  # out of order
        if known is None:
            digest = frozenset(report.prefix_digest)
            self._workers[wid] = _Worker(report, digest)
            self._slots = None
        else:
            if known.report.role != report.role:
                self.corrector.forget(wid)  # its predictions are a new role's now
            if known.report.prefix_digest != report.prefix_digest:
                known.digest = frozenset(report.prefix_digest)
            known.report = report
        self._stale.add(wid)
        self._view = None

    def mark_dead(self, worker_id: str) -> None:
        self._dead.add(worker_id)
        if self._workers.pop(worker_id, None) is not None:
            self._slots = None
            self._stale.discard(worker_id)
            self._view = None
        for request_id in self._by_worker.pop(worker_id, {}):
            self._drop_reservation(request_id)
        self._links.pop(worker_id, None)
        self._published_links.pop(worker_id, None)
        self.corrector.forget(worker_id)

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def reports(self) -> dict[str, WorkerReport]:
        return {wid: w.report for wid, w in self._workers.items()}

    def observe_outcome(self, output_len: int, outcome: Outcome | None = None) -> None:
        """A finished request's output length (the history H of the KV estimator) and,
        if measured, its TTFT/TPOT against its plan's predictions (the corrections
        that admission prices plans with)."""
        if outcome is not None:
            self.corrector.observe(outcome)
            self.admission.observe(outcome)
        self._output_lens.append(output_len)
        self._output_tuple = ()
        self._view = None

    # -- deciding ----------------------------------------------------------------------
    def view(self) -> ClusterView:
        """The cluster as the policy sees it: telemetry plus reservations."""
        view = self._view
        if view is not None:
            return view
        if not self._output_tuple and self._output_lens:
            self._output_tuple = tuple(self._output_lens)
        slots = self._slots
        stale = self._stale
        if slots is None:
            self._index = {wid: i for i, wid in enumerate(self._workers)}
            slots = self._slots = []
            for wid, w in self._workers.items():
                if w.view is None or wid in stale:
                    w.view = self._worker_view(wid, w)
                slots.append(w.view)
        else:
            for wid in stale:
                w = self._workers[wid]
                w.view = slots[self._index[wid]] = self._worker_view(wid, w)
        stale.clear()
        view = self._view = ClusterView(tuple(slots), self._output_tuple)
        return view

    def place(
        self, profile: RequestProfile, now_s: float, *, replaced: bool = False
    ) -> Plan | Hold | Reject:
        """Plan ``profile``; a plan is reserved on its workers until ``release``.

        ``replaced``: a failover re-placement; its age is not held against it (the
        TTFT budget counts from now) and its length is not observed again."""
        if replaced:
            profile = dataclasses.replace(profile, arrival_s=now_s)
        elif profile.request_id not in self._observed:
            self._observed.add(profile.request_id)
            self._observe_request(profile)
        view = self.view()
        decision = self.policy.plan(profile, view, now_s)
        if isinstance(decision, Reject):
            if decision.hold:
                return Hold(decision.reason, decision.retry_after_s)
            self._observed.discard(profile.request_id)
            if decision.retryable:  # a hopeless request (too long for any worker) says
                self.refusals.refused(now_s, decision.reason)  # nothing of the roles' mix
            return decision
        if profile.num_images and not hasattr(self.policy, "observe_encode"):
            decision = _with_encode_worker(decision, view, profile.num_images)
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
        """``worker_id``'s telemetry counts the request now: drop its part of the
        reservation. No ``worker_id``: the request finished, failed or gave up waiting;
        drop all of it (and, if it was held, its place)."""
        if worker_id is not None:
            self._drop_reservation(request_id, worker_id)
            return
        self._observed.discard(request_id)
        self._drop_reservation(request_id)

    def observe_transfer(
        self, prefill_worker: str, decode_worker: str, num_bytes: int, duration_s: float
    ) -> None:
        """A KV pull from ``prefill_worker`` to ``decode_worker`` finished: both ends'
        links are refitted (a pair is priced by its slower end)."""
        seed = self.settings.profile.transfer
        for wid in (prefill_worker, decode_worker):
            fit = self._links.get(wid)
            if fit is None:
                fit = self._links[wid] = LinkFit(seed)
            estimate = fit.observe(num_bytes, duration_s)
            shown = self._published_links.get(wid)
            if shown is None or _moved(shown, estimate):
                self._published_links[wid] = estimate
                self._invalidate(wid)

    def observe_encode(self, worker_id: str, num_image_tokens: int, duration_s: float) -> None:
        """An encode on ``worker_id`` took ``duration_s`` (worker clock): for a policy
        that prices encodes (``observe_encode``), the encode term is refitted."""
        observe = getattr(self.policy, "observe_encode", None)
        if callable(observe):
            observe(worker_id, num_image_tokens, duration_s)

    def link(self, worker_id: str) -> TransferCoeffs:
        """The worker's link as measured (the profile's until a transfer is seen)."""
        fit = self._links.get(worker_id)
        return fit.estimate if fit is not None else self.settings.profile.transfer

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
        without its first event (0 with none): the worker's queue as it is now, however
        slowly it runs, where the view shows it as last reported and as modelled."""
        for r in self._placed(worker_id, prefill=True):  # oldest first
            if r.placed_s is not None:
                return max(0.0, now_s - r.placed_s)
        return 0.0

    def recent_step_s(self, worker_id: str) -> float:
        """The median of the last few decode steps ``worker_id`` reported while it runs
        requests (0 when it runs none: an idle worker's old steps say nothing of the
        next one): the decode worker's speed as it is now."""
        steps = self._recent_steps(worker_id, prefill=False)
        return statistics.median(s.duration_s for s in steps) if steps else 0.0

    def recent_slowdown(self, worker_id: str, *, prefill: bool = False) -> float:
        """How much slower than its cost model ``worker_id``'s last few decode steps
        (``prefill``: steps that prefilled) ran while it has that work: the median of
        measured / modelled; 0 when it has none (runs no request and has none placed to
        decode there; ``prefill``: has no prompt waiting or placed on it) or the policy
        keeps no cost model. The model is fitted from the same steps but over hundreds,
        each weighed by its relative error, which favours the fast ones: where the speed
        has just fallen (a loaded host, a grown batch on a CPU that computes it no
        faster), this ratio knows it at once. A ratio is per step of whatever batch ran,
        so an idle decode worker's last steps still price a burst placed on it: the first
        request goes by the plan's own prediction, the ones after it at that speed (live,
        2 prefill + 2 decode offered 48 req/s after a pause: 85 requests were admitted in
        the first 2 s on the model's figures alone, 35 of them missed TPOT, and the grown
        batches locked everyone out for 6 s while they drained)."""
        cost_model = getattr(self.policy, "cost_model", None)
        steps = self._recent_steps(worker_id, prefill=prefill, placed=True)
        if not callable(cost_model) or not steps:
            return 0.0
        model = cost_model(worker_id)
        ratios = []
        for s in steps:
            modelled = model.step_s(s.num_prefill_tokens, s.num_decode_seqs, s.total_context_tokens)
            if modelled > 0:
                ratios.append(s.duration_s / modelled)
        return statistics.median(ratios) if ratios else 0.0

    def _recent_steps(
        self, worker_id: str, *, prefill: bool, placed: bool = False
    ) -> list[StepSample]:
        """The last few decode-only steps (``prefill``: steps that prefilled) that
        ``worker_id`` reported, while it has that work now (runs a request, or with
        ``placed`` has one placed to decode there; ``prefill``: has a prompt waiting or
        placed on it); none otherwise."""
        w = self._workers.get(worker_id)
        if w is None:
            return []
        if prefill:
            waiting = next(self._placed(worker_id, prefill=True), None)
            busy = bool(w.report.waiting_prompt_lens) or waiting is not None
        else:
            busy = bool(w.report.running) or (
                placed and next(self._placed(worker_id, prefill=False), None) is not None
            )
        if not busy:
            return []
        steps = [s for s in w.report.recent_steps if (s.num_prefill_tokens > 0) == prefill]
        return steps[-_RECENT_STEPS:]

    def _placed(self, worker_id: str, *, prefill: bool) -> Iterator[_Reservation]:
        """Reservations that prefill (``prefill``) or decode on ``worker_id``, oldest
        first (a colocated plan decodes on its prefill worker)."""
        reservations = self._reservations
        for rid in self._by_worker.get(worker_id, {}):
            plan = reservations[rid].plan
            there = plan.prefill_worker if prefill else plan.decode_worker or plan.prefill_worker
            if there == worker_id:
                yield reservations[rid]

    def block_size(self) -> int | None:
        """The KV block size prompts are hashed by for prefix matching (the smallest)."""
        sizes = [w.report.block_size for w in self._workers.values()]
        return min(sizes) if sizes else None

    def num_reservations(self) -> int:
        return len(self._reservations)

    def use_policy(self, name: str) -> None:
        """Place with the policy ``name`` from now on (same settings, view, reservations
        and θ); placed requests are unaffected."""
        self.settings = dataclasses.replace(self.settings, policy=name)
        self.policy = make_policy_from_settings(name, self.settings.policy_options(self.classifier))

    # -- internals ---------------------------------------------------------------------
    def _observe_request(self, profile: RequestProfile) -> None:
        """Once per request: θ and the mean prompt length move with new traffic only."""
        self.classifier.observe(effective_prefill_tokens(profile))
        n = profile.num_prompt_tokens + profile.num_image_tokens
        m = self.mean_prompt_tokens
        self.mean_prompt_tokens = n if m == 0 else m + _PROMPT_EMA_WEIGHT * (n - m)

    def reserve(self, profile: RequestProfile, plan: Plan, placed_s: float | None = None) -> None:
        """Hold what ``plan`` will take on its workers until ``release`` (``place`` does
        this for its plans, at ``placed_s``; for a plan made elsewhere, e.g. an operator
        pinning)."""
        rid = profile.request_id
        self._drop_reservation(rid)
        tokens = effective_prefill_tokens(profile)
        touched = _touched(plan)
        self._reservations[rid] = _Reservation(
            plan,
            set(touched),
            tokens,
            self.classifier.classify(tokens),
            profile.num_prompt_tokens + profile.num_image_tokens,
            profile.max_tokens,
            placed_s,
            profile.num_image_tokens,
            _encode_tokens(plan, profile),
        )
        for wid in touched:
            self._by_worker.setdefault(wid, {})[rid] = None
            self._invalidate(wid)

    def _drop_reservation(self, request_id: str, worker_id: str | None = None) -> None:
        r = self._reservations.get(request_id)
        if r is None:
            return
        dropped = set(r.workers) if worker_id is None else r.workers & {worker_id}
        for wid in dropped:
            r.workers.discard(wid)
            ids = self._by_worker.get(wid)
            if ids is not None:
                ids.pop(request_id, None)
            self._invalidate(wid)
        if not r.workers:
            del self._reservations[request_id]

    def _invalidate(self, worker_id: str) -> None:
        if worker_id in self._workers:
            self._stale.add(worker_id)
            self._view = None

    def _worker_view(self, wid: str, w: _Worker) -> WorkerView:
        s = w.report
        theta = self.classifier.threshold_tokens  # classify(n): short iff n < θ
        short_tokens = long_tokens = num_short = num_long = 0
        for n in s.waiting_prompt_lens:
            if n < theta:
                short_tokens += n
                num_short += 1
            else:
                long_tokens += n
                num_long += 1
        queued_tokens = {LengthClass.SHORT: short_tokens, LengthClass.LONG: long_tokens}
        queued_requests = {LengthClass.SHORT: num_short, LengthClass.LONG: num_long}
        running = s.running
        num_free_blocks = s.num_free_blocks
        link = self._published_links.get(wid)
        reserved = self._by_worker.get(wid, ())
        inbound_tokens = 0
        if reserved:
            added: list[RunningRequest] = []
            for rid in reserved:
                r = self._reservations[rid]
                if r.plan.prefill_worker == wid:
                    queued_tokens[r.length_class] += r.prefill_tokens
                    queued_requests[r.length_class] += 1
                if r.plan.encode_worker == wid or r.encode_tokens:  # an encode queue: images
                    share = (
                        r.image_tokens if r.encode_tokens is None else r.encode_tokens.get(wid, 0)
                    )
                    queued_tokens[LengthClass.SHORT] += share
                    queued_requests[LengthClass.SHORT] += 1 if share else 0
                if (r.plan.decode_worker or r.plan.prefill_worker) == wid:
                    num_free_blocks -= math.ceil((r.held_tokens + 1) / s.block_size)
                    row = r.running
                    if row is None:
                        row = r.running = RunningRequest(r.held_tokens, 0, r.max_tokens)
                    added.append(row)
                    if r.plan.prefill_worker != wid:  # its KV comes over this worker's link
                        inbound_tokens += r.held_tokens
            if added:
                running = (*running, *added)
        return WorkerView(
            worker_id=wid,
            role=s.role,
            num_total_blocks=s.num_total_blocks,
            num_free_blocks=max(0, num_free_blocks),
            block_size=s.block_size,
            queued_tokens=queued_tokens,
            queued_requests=queued_requests,
            # The report's own tuple when nothing is reserved here: the policy's per-worker
            # caches key on it, so a reservation released brings their old entry back.
            running=running,
            recent_steps=s.recent_steps,
            kv_bytes_per_token=s.kv_bytes_per_token,
            max_num_seqs=s.max_num_seqs,
            draining=s.draining,
            prefix_digest=w.digest,
            prefill_budget_tokens=s.prefill_budget_tokens,
            link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s if link else 0.0,
            link_latency_s=link.latency_s if link else None,
            inbound_tokens=inbound_tokens,
        )


def _with_encode_worker(plan: Plan, view: ClusterView, num_images: int) -> Plan:
    """For a policy that does not price encodes: the request's images spread over the
    encode workers with the fewest queued image tokens, one part per worker, if there
    are any (an operator who started encode workers wants images encoded there)."""
    encoders = view.by_role(Role.ENCODE)
    if not encoders or plan.encode_worker is not None:
        return plan
    ranked = sorted(encoders, key=lambda w: sum(w.queued_tokens.values()))
    parts = split_images(max(1, num_images), tuple(w.worker_id for w in ranked))
    split = parts if len(parts) > 1 else ()
    return dataclasses.replace(plan, encode_worker=parts[0][0], encode_parts=split)


def _encode_tokens(plan: Plan, profile: RequestProfile) -> dict[str, int] | None:
    """A split plan: each encode worker's share of the image tokens (by its images)."""
    if not plan.encode_parts:
        return None
    per_image = profile.num_image_tokens / max(1, profile.num_images)
    shares: dict[str, int] = {}
    for wid, start, stop in plan.encode_parts:
        shares[wid] = shares.get(wid, 0) + round((stop - start) * per_image)
    return shares


def _touched(plan: Plan) -> tuple[str, ...]:
    decode = plan.decode_worker or plan.prefill_worker
    touched = (
        (plan.prefill_worker,) if decode == plan.prefill_worker else (plan.prefill_worker, decode)
    )
    return (*touched, *plan.encode_workers)


def _moved(shown: TransferCoeffs, now: TransferCoeffs) -> bool:
    bw, lat = shown.bandwidth_bytes_per_s, shown.latency_s
    return abs(now.bandwidth_bytes_per_s - bw) > _LINK_TOLERANCE * bw or abs(
        now.latency_s - lat
    ) > _LINK_TOLERANCE * max(lat, 1e-4)
