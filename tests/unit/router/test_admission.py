"""Admission that learns, through ``router.Router``: plans priced again by each worker's
learned correction; what will miss is refused at once (never held), ``batch`` first."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from router.admission import AdmissionSettings
from router.correction import Outcome
from router.cost_model import CostModel
from router.front_door import Hold, Router, RouterSettings
from router.live_speed import MAX_COMPUTE_SLOWDOWN, NO_SLOWDOWN, Slowdown
from router.types import (
    SLO,
    Plan,
    Priority,
    Reject,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
)
from tests.unit.router.builders import PROFILE, FakePredictingPolicy
from tests.unit.router.test_front_door import snapshot

TARGET = SLO(ttft_s=1.0, tpot_s=0.1)


def build(policy: Any) -> Router:
    r = Router(RouterSettings(policy="round_robin", default_slo=TARGET), policy=policy)
    r.update(snapshot("p", Role.PREFILL))
    r.update(snapshot("d", Role.DECODE))
    return r


def teach(r: Router, ttft_factor: float = 1.0, tpot_factor: float = 1.0) -> None:
    """Requests finish this many times slower than predicted."""
    for i in range(12):
        predicted = 0.2 + 0.05 * i  # 0.2-0.75 s: the predictions asked about below
        r.observe_outcome(
            10,
            Outcome("p", "d", predicted, ttft_factor * predicted, 0.05, tpot_factor * 0.05),
        )


def ask(r: Router, rid: str, priority: Priority = Priority.INTERACTIVE) -> Any:
    return r.place(RequestProfile(rid, 100, 100, 16, priority=priority, arrival_s=0.0), 0.0)


def test_an_honest_model_admits_everything() -> None:
    r = build(FakePredictingPolicy(ttft_s=0.75))
    teach(r)
    assert isinstance(ask(r, "i"), Plan)
    assert isinstance(ask(r, "b", Priority.BATCH), Plan)  # 0.75 < 0.8 x 1.0


def test_batch_is_shed_first_then_interactive_as_the_worker_slows() -> None:
    r = build(FakePredictingPolicy(ttft_s=0.5))
    teach(r, ttft_factor=1.8)  # 0.5 -> 0.9: batch (0.8 s) misses, interactive (1 s) meets
    batch = ask(r, "b", Priority.BATCH)
    assert isinstance(batch, Reject) and batch.reason == "predicted ttft miss (model)"
    assert isinstance(ask(r, "i"), Plan)
    teach(r, ttft_factor=2.4)  # slower still: 0.5 -> over 1 s, interactive misses too
    refused = ask(r, "i2")
    assert isinstance(refused, Reject) and not isinstance(refused, Hold)
    assert refused.retry_after_s >= 1.0 and r.num_reservations() == 1  # only "i" holds room


def busy(r: Router, step_s: float, seq: int = 2) -> None:
    """``d`` runs a request and its last decode steps took ``step_s`` (report ``seq``)."""
    steps = tuple(StepSample(step_s, 0, 8, 800, end_s=float(seq + i)) for i in range(4))
    running = (RunningRequest(100, 5, 16),)
    report = snapshot("d", Role.DECODE, seq, running=running)
    r.update(dataclasses.replace(report, recent_steps=steps))


def test_a_slow_decode_worker_refuses_by_tpot_while_busy_and_takes_one_when_idle() -> None:
    r = build(FakePredictingPolicy(tpot_s=0.05))
    teach(r, tpot_factor=3.0)
    assert isinstance(ask(r, "idle"), Plan)  # alone it would show its speed: admitted
    busy(r, 0.05)  # its steps are quick just now, but it taught 3x: 0.15 s > 0.1 s
    refused = ask(r, "i")
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"


def test_the_age_of_a_request_counts_against_its_ttft() -> None:
    r = build(FakePredictingPolicy(ttft_s=0.5))
    teach(r)
    profile = RequestProfile("old", 100, 100, 16, arrival_s=0.0)
    assert isinstance(r.place(profile, 0.6), Reject)  # 0.6 s waited + 0.5 s > 1 s


def test_re_placements_and_unpredicted_plans_are_never_judged() -> None:
    r = build(FakePredictingPolicy(ttft_s=0.5))
    teach(r, ttft_factor=4.0)
    profile = RequestProfile("x", 100, 100, 16)
    assert isinstance(r.place(profile, 0.0, replaced=True), Plan)  # its stream started
    r = build(FakePredictingPolicy(ttft_s=None, tpot_s=None))
    teach(r, ttft_factor=4.0)
    assert isinstance(ask(r, "y"), Plan)


def test_a_worker_that_changes_role_starts_afresh() -> None:
    r = build(FakePredictingPolicy(ttft_s=0.5))
    teach(r, ttft_factor=4.0)
    assert isinstance(ask(r, "a"), Reject)
    r.update(snapshot("p", Role.MIXED, seq=2))
    assert isinstance(ask(r, "b"), Plan)


def test_a_queue_that_has_kept_its_head_waiting_refuses_before_the_model_learns_it() -> None:
    """The model says 0.5 s and nothing has been learned yet, but the request placed on p
    1.2 s ago still has no first token: a newcomer would wait about as long, and misses
    its 1 s target. Once p answers the old one (its telemetry counts it), p admits."""
    r = build(FakePredictingPolicy(ttft_s=0.5))
    old = RequestProfile("old", 100, 100, 16, arrival_s=0.0)
    assert isinstance(r.place(old, 0.0), Plan)
    assert r.pending_age_s("p", 1.2) == 1.2 and r.pending_age_s("d", 1.2) == 0.0
    late = r.place(RequestProfile("new", 100, 100, 16, arrival_s=1.2), 1.2)
    assert isinstance(late, Reject) and late.reason == "predicted ttft miss (queue wait)"
    assert late.retry_after_s >= 1.2
    r.release("old", "p")  # p's first event for it: p's queue no longer holds it
    assert isinstance(r.place(RequestProfile("new2", 100, 100, 16, arrival_s=1.2), 1.2), Plan)


def test_a_prompt_that_would_make_those_waiting_for_its_step_late_is_refused() -> None:
    """An engine step takes every waiting prompt up to its token budget, and each one's
    first token comes as the step ends. ``first``, placed on p after p's last report,
    waits for p's next step, due by 1 s; a newcomer at 0.6 s, predicted 0.6 s (the
    queue's head has waited that long), would meet its own target but end that step at
    1.2 s. Once p reports again (its step with ``first`` is running), or where
    ``first`` alone fills the step's budget, the newcomer waits for a later step and
    makes no one late."""

    def router(budget: int) -> Router:
        r = build(FakePredictingPolicy(ttft_s=0.5))
        snap = snapshot("p", Role.PREFILL, 2)
        r.update(dataclasses.replace(snap, prefill_budget_tokens=budget))
        assert isinstance(r.place(RequestProfile("first", 100, 100, 16, arrival_s=0.0), 0.0), Plan)
        return r

    def newcomer(r: Router, rid: str) -> Any:
        return r.place(RequestProfile(rid, 100, 100, 16, arrival_s=0.6), 0.6)

    r = router(budget=2048)
    late = newcomer(r, "new")
    assert isinstance(late, Reject) and late.reason == "predicted ttft miss (shared step)"
    snap = snapshot("p", Role.PREFILL, 3)
    r.update(dataclasses.replace(snap, prefill_budget_tokens=2048))
    assert isinstance(newcomer(r, "new2"), Plan)
    assert isinstance(newcomer(router(budget=100), "new3"), Plan)


def test_a_worker_refused_while_it_was_slow_is_tried_again_once_that_has_aged_out() -> None:
    """Refusing everything, a worker teaches nothing new: what it taught while slow must
    not keep it refused for good (a live 2 prefill + 2 decode cluster refused every
    request, even at a quarter of its capacity, after one slow spell)."""
    r = build(FakePredictingPolicy(ttft_s=0.5))
    for i in range(12):
        r.observe_outcome(10, Outcome("p", "d", 0.5, 1.5, 0.05, 0.05, at_s=float(i)))
    late = RequestProfile("i", 100, 100, 16, arrival_s=12.0)
    assert isinstance(r.place(late, 12.0), Reject)  # 3x slower prefills: a TTFT miss
    max_age_s = r.corrector.settings.max_age_s
    later = RequestProfile("j", 100, 100, 16, arrival_s=12.0 + max_age_s)
    assert isinstance(r.place(later, 12.0 + max_age_s), Plan)


def test_a_decode_worker_whose_steps_run_past_tpot_takes_no_one_more_until_idle() -> None:
    """The model says 0.05 s and nothing has been learned yet, but d's last decode steps
    took 0.3 s (contention) while it runs requests: over the 0.1 s TPOT target, so it
    refuses. Once it runs nothing, those old steps say nothing of the next one."""
    r = build(FakePredictingPolicy(tpot_s=0.05))
    busy(r, 0.3)
    assert r.recent_step_s("d") == 0.3 and r.recent_step_s("p") == 0.0
    refused = ask(r, "i")
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"
    slow = r.reports()["d"].recent_steps
    r.update(dataclasses.replace(snapshot("d", Role.DECODE, 3), recent_steps=slow))
    assert r.recent_step_s("d") == 0.0
    assert isinstance(ask(r, "j"), Plan)


class FakeModelledPolicy(FakePredictingPolicy):
    """Plans with fixed predictions and keeps ``slo_goodput``'s per-worker cost models
    (a fake: tests only)."""

    def __init__(self, tpot_s: float) -> None:
        super().__init__(tpot_s=tpot_s)
        self.model = CostModel(PROFILE)

    def cost_model(self, worker_id: str) -> CostModel:
        return self.model


def test_a_plan_is_priced_at_the_speed_the_decode_worker_steps_now() -> None:
    """d's last steps ran 1.5x slower than its model says for their batch (0.0163 s, far
    within the 0.1 s target), but the plan's step with this request, 0.08 s as modelled,
    is 0.12 s at that speed: refused before the grown batch shows it. At the model's
    speed it is taken, and so it is on an idle worker, whose old steps say nothing."""
    r = build(FakeModelledPolicy(tpot_s=0.08))
    modelled_s = CostModel(PROFILE).decode_step_s(8, 800)
    busy(r, 1.5 * modelled_s)
    assert r.recent_slowdown("d") == Slowdown(pytest.approx(1.5), 0.0)
    refused = ask(r, "i")
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"
    busy(r, modelled_s, seq=3)
    assert isinstance(ask(r, "j"), Plan)
    r.update(snapshot("d", Role.DECODE, 4))
    assert r.recent_slowdown("d") == NO_SLOWDOWN


def test_steps_far_slower_than_compute_slows_are_priced_as_waiting_not_as_scale() -> None:
    """d's last steps ran 8x their model (a process pre-empted on a shared host). Up to
    4x is compute, which scales with the plan's step; the rest is a wait per step,
    which does not. A 0.013 s plan is then 4 x 0.013 + 4 x 0.0101 = 0.092 s, within the
    0.1 s target (as a ratio it was 8 x 0.013 = 0.104 s, refused); a 0.03 s plan is
    0.16 s and still refused."""
    assert MAX_COMPUTE_SLOWDOWN == 4.0
    modelled_s = CostModel(PROFILE).decode_step_s(1, 40)
    steps = tuple(StepSample(8 * modelled_s, 0, 1, 40, end_s=float(i)) for i in range(4))
    report = snapshot("d", Role.DECODE, 2, running=(RunningRequest(40, 5, 16),))

    def judged(plan_tpot_s: float) -> Any:
        r = build(FakeModelledPolicy(tpot_s=plan_tpot_s))
        r.update(dataclasses.replace(report, recent_steps=steps))
        assert r.recent_slowdown("d") == Slowdown(4.0, pytest.approx(4 * modelled_s))
        return ask(r, "i")

    assert isinstance(judged(0.013), Plan)
    refused = judged(0.03)
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"


def test_a_plan_is_priced_at_the_speed_the_prefill_worker_prefills_now() -> None:
    """p's last prefills ran 2.5x slower than its model says while a prompt waits there:
    the plan's 0.5 s TTFT is 1.25 s at that speed, past the 1 s target, so it is refused
    before any request placed there has waited long. With no prompt waiting, p's old
    steps say nothing of the next one and the plan is taken as predicted."""
    r = build(FakeModelledPolicy(tpot_s=0.05))
    steps = tuple(
        StepSample(2.5 * CostModel(PROFILE).prefill_s(400), 400, 0, 0, end_s=float(i))
        for i in range(4)
    )
    queued = snapshot("p", Role.PREFILL, 2, waiting=(400,))
    r.update(dataclasses.replace(queued, recent_steps=steps))
    assert r.recent_slowdown("p", prefill=True) == Slowdown(pytest.approx(2.5), 0.0)
    refused = ask(r, "i")
    assert isinstance(refused, Reject) and refused.reason == "predicted ttft miss (prefill speed)"
    r.update(dataclasses.replace(snapshot("p", Role.PREFILL, 3), recent_steps=steps))
    assert r.recent_slowdown("p", prefill=True) == NO_SLOWDOWN
    assert isinstance(ask(r, "j"), Plan)


def prefilling_at(r: Router, scale: float, seq: int) -> None:
    """p reports a prompt waiting and its last prefills ``scale`` times its model."""
    steps = tuple(
        StepSample(scale * CostModel(PROFILE).prefill_s(400), 400, 0, 0, end_s=float(seq + i))
        for i in range(4)
    )
    queued = snapshot("p", Role.PREFILL, seq, waiting=(400,))
    r.update(dataclasses.replace(queued, recent_steps=steps))


def test_a_speed_the_ttft_correction_learned_at_is_not_counted_again() -> None:
    """p prefills steadily 1.5x slower than its model, and the requests placed at that
    speed met their predicted TTFTs: the correction learned that 1.5x costs nothing
    more. A 0.75 s plan is then taken at 0.75 s (priced 1.5x over the model, as before,
    it was 1.125 s, past the 1 s target). When p's prefills fall to 3x its model, twice
    the speed learned at, the same plan is 1.5 s: refused on the prefill speed before
    the correction can know."""
    policy = FakeModelledPolicy(tpot_s=0.05)
    r = build(policy)
    prefilling_at(r, 1.5, seq=2)
    assert isinstance(ask(r, "a"), Plan)  # 0.5 s at 1.5x: 0.75 s, within the target
    r.release("a")
    teach(r)  # what was placed at that speed met its predictions
    policy.ttft_s = 0.75
    assert isinstance(ask(r, "b"), Plan)
    r.release("b")
    prefilling_at(r, 3.0, seq=10)
    refused = ask(r, "c")
    assert isinstance(refused, Reject) and refused.reason == "predicted ttft miss (prefill speed)"
    assert refused.retry_after_s == pytest.approx(1.5)


def test_a_burst_on_an_idle_decode_worker_is_priced_at_its_last_speed_after_the_first() -> None:
    """d ran 1.5x slower than modelled, then went idle (its last steps still reported).
    The first request placed there goes by the plan's 0.08 s; the next, with the first
    placed there, is priced at d's last speed, 0.12 s, past the 0.1 s target."""
    r = build(FakeModelledPolicy(tpot_s=0.08))
    modelled_s = CostModel(PROFILE).decode_step_s(8, 800)
    busy(r, 1.5 * modelled_s)
    slow = r.reports()["d"].recent_steps
    r.update(dataclasses.replace(snapshot("d", Role.DECODE, 3), recent_steps=slow))
    assert r.recent_step_s("d") == 0.0 and r.recent_slowdown("d") == NO_SLOWDOWN
    assert isinstance(ask(r, "first"), Plan)
    assert r.recent_slowdown("d") == Slowdown(pytest.approx(1.5), 0.0)
    refused = ask(r, "second")
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"
    r.release("first")  # nothing placed there any more: the next one goes by the plan
    assert isinstance(ask(r, "third"), Plan)


def finished(missed_tpot: bool, missed_ttft: bool = False) -> Outcome:
    """An admitted request's outcome, as its client saw it."""
    return Outcome(
        "p", "d", 0.5, 0.5, 0.05, 0.05, met_ttft=not missed_ttft, met_tpot=not missed_tpot
    )


def test_admitted_requests_missing_tpot_shrink_its_headroom_until_they_meet_it_again() -> None:
    """A plan predicted at 0.09 s fits the full 0.1 s TPOT target; after admitted requests
    missed it, admission uses less of the target and refuses it, TTFT's share untouched;
    requests that meet the target give the share back."""
    r = build(FakePredictingPolicy(ttft_s=0.85, tpot_s=0.09))
    assert isinstance(ask(r, "before"), Plan)
    for _ in range(3):
        r.observe_outcome(10, finished(missed_tpot=True))
    assert r.admission.guard.tpot == pytest.approx(0.85) and r.admission.guard.ttft == 1.0
    refused = ask(r, "after")
    assert isinstance(refused, Reject) and refused.reason == "predicted tpot miss"
    for _ in range(150):
        r.observe_outcome(10, finished(missed_tpot=False))
    assert r.admission.guard.tpot == 1.0
    assert isinstance(ask(r, "again"), Plan)


def test_a_spell_of_misses_is_forgotten_over_the_recovery_time() -> None:
    """Ten admitted requests missed their TTFT at 100 s: the share is at its 0.5 floor and
    a plan predicted at 0.85 s is refused against the 1 s target. With no miss since,
    the share has made up 1 - 1/e of what it lacked one recovery time later (0.82, still
    refusing), and 0.93 two later, where the same plan is taken."""
    r = build(FakePredictingPolicy(ttft_s=0.85, tpot_s=0.05))
    for _ in range(10):
        r.observe_outcome(10, dataclasses.replace(finished(False, True), at_s=100.0))
    guard = r.admission.guard
    assert guard.ttft == pytest.approx(guard.FLOOR)

    def ask_at(rid: str, now_s: float) -> Any:
        return r.place(RequestProfile(rid, 100, 100, 16, arrival_s=now_s), now_s)

    assert isinstance(ask_at("a", 100.0), Reject)
    recovery_s = guard.RECOVERY_S
    assert isinstance(ask_at("b", 100.0 + recovery_s), Reject)
    assert guard.ttft == pytest.approx(1.0 - 0.5 / math.e)
    assert isinstance(ask_at("c", 100.0 + 2 * recovery_s), Plan)
    assert guard.ttft == pytest.approx(1.0 - 0.5 / math.e**2) and guard.tpot == 1.0


def test_the_headroom_share_has_a_floor_and_stays_put_when_not_adaptive() -> None:
    r = build(FakePredictingPolicy())
    for _ in range(100):
        r.observe_outcome(10, finished(missed_tpot=True, missed_ttft=True))
    assert (r.admission.guard.ttft, r.admission.guard.tpot) == (0.5, 0.5)
    fixed = Router(
        RouterSettings(
            policy="round_robin", default_slo=TARGET, admission=AdmissionSettings(adaptive=False)
        ),
        policy=FakePredictingPolicy(),
    )
    fixed.observe_outcome(10, finished(missed_tpot=True, missed_ttft=True))
    assert (fixed.admission.guard.ttft, fixed.admission.guard.tpot) == (1.0, 1.0)


def test_requests_placed_unjudged_leave_the_headroom_share_alone() -> None:
    """Outcomes whose plans predicted nothing (``round_robin``, or placed before a switch
    to a predicting policy) missed their targets without admission having trusted a
    prediction: the shares stay put, and one predicted target moves only its own."""
    r = build(FakePredictingPolicy())
    unjudged = Outcome("p", "d", None, 2.0, None, 0.5, met_ttft=False, met_tpot=False)
    for _ in range(20):
        r.observe_outcome(10, unjudged)
    assert (r.admission.guard.ttft, r.admission.guard.tpot) == (1.0, 1.0)
    ttft_only = Outcome("p", "d", 0.5, 2.0, None, 0.5, met_ttft=False, met_tpot=False)
    r.observe_outcome(10, ttft_only)
    assert (r.admission.guard.ttft, r.admission.guard.tpot) == (pytest.approx(0.95), 1.0)
