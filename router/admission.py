"""Admission that learns: refuse at once what the corrected cost model says will miss.

A policy that predicts (``Plan.predicted_ttft_s`` / ``predicted_tpot_s``, as
``slo_goodput`` does) plans with its cost model; ``Admission.judge`` then prices that plan
again through the workers' learned corrections (``router.correction``) and refuses it,
before anything is reserved or queued, when

* the request's age plus its corrected TTFT passes ``headroom × TTFT target`` (the
  corrected TTFT is at least how long the oldest request placed on the same prefill
  worker has waited for its first token so far, the queue as it is now, and the
  plan's TTFT at the speed that worker's recent prefills ran against its cost model
  while prompts wait there: once its correction has learned, only as far as that speed
  is slower than the one the correction learned at), or
* its corrected TTFT would bring the end of the engine step its prompt joins past the
  first-token deadline of a prompt already waiting for that step
  (``Router.place`` passes the earliest: ``router.live_speed.shared_step_deadline_s``),
  or
* its decode worker would step slower than ``headroom × TPOT target``: while it runs
  requests, by its corrected prediction or by its recent steps as they are; and,
  while it runs or has requests placed there, by the plan's step (what is reserved
  there and this request) at the speed of its last steps against the model
  (``Router.recent_slowdown``),

where ``headroom`` is ``headroom`` for ``interactive`` and ``batch_headroom`` (lower) for
``batch`` requests, each times the share the ``AttainmentGuard`` learned from admitted
requests' outcomes (with ``adaptive``): as a worker slows, batch requests are refused first, and interactive
ones only when they too would miss. An interactive headroom under 1 keeps the operating
point below the targets: admitting while predictions reach the target itself fills
queues and batches until the typical admitted request sits at its target, where noise
alone makes about half of them miss. A refusal is a ``Reject`` with ``retry_after_s`` (the
corrected TTFT of the plan, at least ``min_retry_after_s``): the gateway answers it
with a 429 and ``Retry-After`` at once, never after a hold. Plans with no prediction
(``round_robin``, ``least_loaded``, ``prefix_aware``) pass unjudged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.correction import Outcome, OutcomeCorrector
from router.live_speed import NO_SLOWDOWN, JudgedSpeeds, Slowdown
from router.types import SLO, Plan, Priority, Reject, RequestProfile

__all__ = ["Admission", "AdmissionSettings", "AttainmentGuard"]


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    enabled: bool = True
    headroom: float = 1.0
    batch_headroom: float = 0.8
    min_retry_after_s: float = 1.0
    adaptive: bool = True  # scale both headrooms by what admitted requests attained


class AttainmentGuard:
    """The share of its headroom admission uses, per target, learned from the requests
    it admitted: each one that missed its target takes ``STEP`` off (down to ``FLOOR``),
    each one that met it gives ``STEP × MISS_RATE / (1 − MISS_RATE)`` back (up to 1),
    so the share settles where about ``MISS_RATE`` of admitted requests miss; and what
    misses took off returns with time (``age``), so a spell of misses is forgotten
    within about ``RECOVERY_S`` once it stops.

    Predictions are means; a worker's speed also swings with what runs beside it (on a
    shared host, with the other workers' load). Admitting while predictions reach the
    target itself puts the typical admitted request at its target, where that noise makes
    many miss. Measured live, 2 prefill + 2 decode on 2 cores at 48 req/s with the full
    target: 41 of the 207 admitted missed their TPOT, and the batches they grew locked
    everyone out for seconds; at 0.7 of it, none of 282 missed. The guard finds that
    share from outcomes instead of a fixed setting, and where predictions hold (the
    simulator) it stays at 1."""

    MISS_RATE = 0.02
    STEP = 0.05
    FLOOR = 0.5
    # What misses took off returns over about this long (``age``), as a learned
    # correction's pairs age out (``CorrectionSettings.max_age_s``).
    RECOVERY_S = 30.0

    def __init__(self) -> None:
        self.ttft = 1.0
        self.tpot = 1.0
        self._aged_to_s: float | None = None

    def age(self, now_s: float) -> None:
        """Let each share return toward 1 by ``exp(-elapsed / RECOVERY_S)`` of what it
        lacks: misses say how far predictions could be trusted while they were made,
        not for good. Requests admitted together miss together: live, at the knee of
        the overload sweep (2 prefill + 2 decode), 11 admitted within a few seconds
        missed their TTFT within 2.5 s of each other and took the share from 1.0 to its
        0.5 floor; at 0.001 back per request that met it, it stood at 0.55-0.66 through
        the whole run at 2x the saturation rate after, which refused prompts predicted
        past 4.5-5.6 s while every one admitted met its 9.8 s target."""
        last = self._aged_to_s
        if last is not None and now_s > last:
            keep = math.exp(-(now_s - last) / self.RECOVERY_S)
            self.ttft = 1.0 - (1.0 - self.ttft) * keep
            self.tpot = 1.0 - (1.0 - self.tpot) * keep
        if last is None or now_s > last:
            self._aged_to_s = now_s

    def observe(self, outcome: Outcome) -> None:
        """Only a target admission judged the request by (its plan predicted it) moves
        that share: a request placed unjudged (``round_robin``, or before a switch to
        ``slo_goodput``) says nothing of how far admission's predictions can be trusted.
        Live, on a loaded host, ``round_robin`` phases missing a 1 s TTFT at p90 cut
        the share, and the ``slo_goodput`` phases after them refused short prompts that
        were served in 60 ms (``test_router_live``)."""
        if outcome.at_s is not None:
            self.age(outcome.at_s)
        if outcome.met_ttft is not None and outcome.predicted_ttft_s is not None:
            self.ttft = self._step(self.ttft, not outcome.met_ttft)
        if outcome.met_tpot is not None and outcome.predicted_tpot_s is not None:
            self.tpot = self._step(self.tpot, not outcome.met_tpot)

    def _step(self, share: float, missed: bool) -> float:
        if missed:
            return max(self.FLOOR, share - self.STEP)
        return min(1.0, share + self.STEP * self.MISS_RATE / (1.0 - self.MISS_RATE))


class Admission:
    def __init__(self, settings: AdmissionSettings, corrector: OutcomeCorrector) -> None:
        self.settings = settings
        self.corrector = corrector
        self.guard = AttainmentGuard()
        # The prefill speed each worker's plans were judged at, over about the time its
        # TTFT correction's pairs were learned in.
        self.prefill_speeds = JudgedSpeeds(corrector.settings.max_age_s)

    def forget(self, worker_id: str) -> None:
        """A worker died or changed role: what it taught and how fast it ran go."""
        self.corrector.forget(worker_id)
        self.prefill_speeds.forget(worker_id)

    def observe(self, outcome: Outcome) -> None:
        """A finished request's outcome against its targets (the guard's input)."""
        if self.settings.adaptive:
            self.guard.observe(outcome)

    def judge(
        self,
        profile: RequestProfile,
        plan: Plan,
        now_s: float,
        default_slo: SLO,
        waited_s: float = 0.0,
        step_s: float = 0.0,
        slowdown: Slowdown = NO_SLOWDOWN,
        prefill_slowdown: Slowdown = NO_SLOWDOWN,
        step_deadline_s: float = math.inf,
    ) -> Reject | None:
        """None: admit ``plan``; else why not. ``waited_s``: how long the oldest request
        placed on the plan's prefill worker has waited for its first token so far;
        ``step_s``: the decode worker's recent step time while it runs requests;
        ``slowdown``: how much slower than modelled those steps ran (``Slowdown``);
        ``prefill_slowdown``: the same of the prefill worker's recent prefills while
        prompts wait there; ``step_deadline_s``: the earliest first-token deadline
        (``ttft_deadline_s``) of the prompts the request's prompt would share an engine
        step with (``router.live_speed.shared_step_deadline_s``), which its corrected
        TTFT must not pass."""
        if not self.settings.enabled:
            return None
        settings = self.settings
        if settings.adaptive:
            self.guard.age(now_s)
        headroom = self._headroom(profile)
        ttft_headroom, tpot_headroom = headroom * self.guard.ttft, headroom * self.guard.tpot
        ttft_target_s = profile.slo.ttft_s or default_slo.ttft_s
        tpot_target_s = profile.slo.tpot_s or default_slo.tpot_s
        corrected_ttft_s = 0.0
        if plan.predicted_ttft_s is not None:
            model_s = self.corrector.ttft_s(plan.prefill_worker, plan.predicted_ttft_s, now_s)
            speed_s = self._at_prefill_speed(
                plan.prefill_worker, plan.predicted_ttft_s, model_s, prefill_slowdown, now_s
            )
            if prefill_slowdown.scale > 0.0:  # judged at this speed (priced against the last)
                self.prefill_speeds.observe(plan.prefill_worker, prefill_slowdown.scale, now_s)
            # The queue ahead as it is now: a request joining it waits about as long as
            # the one at its head has (the model and its correction lag behind a
            # worker that has just slowed down, or a burst that has just arrived).
            # The refusal names the estimate that decided it (a 429's reason, and the
            # rejections' label in /metrics): the learned model, the queue's head, or the
            # worker's speed now.
            corrected_ttft_s, bound = max(
                (model_s, "model"),
                (waited_s, "queue wait"),
                (speed_s, "prefill speed"),
                key=lambda term: term[0],
            )
            elapsed_s = max(0.0, now_s - profile.arrival_s)
            if (
                ttft_target_s is not None
                and elapsed_s + corrected_ttft_s > ttft_headroom * ttft_target_s
            ):
                return self._refuse(f"predicted ttft miss ({bound})", corrected_ttft_s)
            if now_s + corrected_ttft_s > step_deadline_s:
                return self._refuse("predicted ttft miss (shared step)", corrected_ttft_s)
        if plan.predicted_tpot_s is not None and tpot_target_s is not None:
            decode = plan.decode_worker or plan.prefill_worker
            corrected_tpot_s = plan.predicted_tpot_s
            # Only a busy decode worker is judged by what it taught and by its steps as
            # they run now: a batch that has slowed past the target takes no one more
            # until it is back within it. An idle one takes the request on the plan's
            # own prediction: what it taught under load says little of its speed
            # alone, and refusing it would leave it idle, teaching nothing, for good.
            if step_s > 0.0:
                corrected_tpot_s = self.corrector.tpot_s(decode, corrected_tpot_s, now_s)
                corrected_tpot_s = max(corrected_tpot_s, step_s)
            # The plan's step (with what is reserved there and this request) at the speed
            # the worker stepped last (0 for the first request placed on an idle one): a
            # batch that keeps growing from the requests still in prefill is refused
            # before its steps show it.
            corrected_tpot_s = max(corrected_tpot_s, slowdown.price(plan.predicted_tpot_s))
            if corrected_tpot_s > tpot_headroom * tpot_target_s:
                return self._refuse("predicted tpot miss", corrected_ttft_s)
        return None

    def ttft_deadline_s(self, profile: RequestProfile, default_slo: SLO) -> float:
        """When the request's first token is due as admission judges it (router
        clock): its arrival plus its priority's headroom times its TTFT target; inf with
        no target or admission off."""
        target_s = profile.slo.ttft_s or default_slo.ttft_s
        if target_s is None or not self.settings.enabled:
            return math.inf
        return profile.arrival_s + self._headroom(profile) * target_s

    def _headroom(self, profile: RequestProfile) -> float:
        """The share of each target the request's priority may use (before the guard)."""
        s = self.settings
        return s.batch_headroom if profile.priority is Priority.BATCH else s.headroom

    def _at_prefill_speed(
        self,
        worker: str,
        predicted_s: float,
        corrected_s: float,
        speed: Slowdown,
        now_s: float,
    ) -> float:
        """A plan's TTFT (``predicted_s`` by the model, ``corrected_s`` as corrected) at
        the speed its prefill ``worker`` prefills now (0: none known).

        Where the worker's TTFT correction has learned, it was learned on plans judged
        at about the speed of lately (``JudgedSpeeds``), so it already prices a worker
        that steadily runs slower than its cost model: only a speed past that one raises
        the corrected TTFT, by their ratio. Priced against the bare model instead, the
        two counted one slowdown twice: live, at 2x the saturation rate (2 prefill + 2
        decode), a prefill worker's steps ran steadily 1.1-1.8x its model, 54 of 55
        refusals were on the prefill speed, and every request admitted met its TTFT, at
        4-7.5 s against a 9.8 s target. With nothing learned yet the plan is priced at
        that speed from its own prediction."""
        if speed.scale <= 0.0:
            return 0.0
        reference = self.prefill_speeds.reference(worker)
        if reference > 0.0 and self.corrector.ttft_learned(worker, now_s):
            return corrected_s * max(1.0, speed.scale / reference) + speed.wait_s
        return speed.price(predicted_s)

    def _refuse(self, reason: str, wait_s: float) -> Reject:
        return Reject(reason, retry_after_s=max(self.settings.min_retry_after_s, wait_s))
