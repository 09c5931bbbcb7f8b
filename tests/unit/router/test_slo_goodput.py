"""slo_goodput on constructed cluster views.

Every worker uses ``builders.PROFILE`` and the output-length history holds one
length (100), so each prediction below is computed by hand in the comments.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from router.types import LengthClass, Plan, Priority, Reject, Role, RunningRequest, StepSample
from tests.unit.router.builders import (
    OUTPUT_LEN,
    SLO_DEFAULT,
    busy,
    plan_of,
    policy,
    prefill_s,
    request,
    view,
    worker,
)

# A 500-token prompt: prefill 0.06 s, transfer 0.05 s + 1 ms; r = 99 for every request.
PROMPT = 500
TTFT_IDLE = prefill_s(PROMPT) + 0.051


def test_picks_the_only_feasible_pair_and_predicts_it() -> None:
    v = view(
        worker("p_deep", Role.PREFILL, short_tokens=20_000, short_requests=2),  # wait 2.02 s
        worker("p_idle", Role.PREFILL),
        worker("d_full", Role.DECODE, busy(10, 1500)),  # peak 10·99 + 15000 > 0.95·16000
        worker("d_slow", Role.DECODE, busy(40, 2000), total_blocks=10_000),  # step 0.0221 s
        worker("d_ok", Role.DECODE, busy(2, 100)),
    )
    plan = plan_of(policy().plan(request(PROMPT), v, 0.0))
    assert (plan.prefill_worker, plan.decode_worker) == ("p_idle", "d_ok")
    assert plan.predicted_ttft_s == pytest.approx(TTFT_IDLE)
    assert plan.predicted_tpot_s == pytest.approx(0.01 + 1e-4 * 3 + 1e-7 * (200 + PROMPT))


def test_rejects_early_when_ttft_is_unreachable() -> None:
    v = view(
        worker("p", Role.PREFILL, short_tokens=20_000, short_requests=2),
        worker("d", Role.DECODE),
    )
    result = policy().plan(request(PROMPT), v, 0.0)
    assert isinstance(result, Reject)
    assert not result.hold and "ttft" in result.reason
    assert result.retry_after_s >= 1.0


def test_prefers_the_emptiest_feasible_decode_worker_and_prices_it_exactly() -> None:
    v = view(
        worker("p", Role.PREFILL),
        worker("d_half", Role.DECODE, busy(6, 1500)),  # peak 9594
        worker("d_light", Role.DECODE, busy(2, 2000)),  # peak 4198
        worker("d_over", Role.DECODE, busy(9, 1600)),  # peak 15291: over the limit
    )
    assert plan_of(policy().plan(request(PROMPT), v, 0.0)).decode_worker == "d_light"
    # Both nearly full, past the cheap bound (peak + c_q + r_q >= limit) so priced exactly:
    # d_fails: r=99, peak 14599 of 15188 (0.961); with the candidate 2·99 + 15000 = 15198 -> over.
    # d_fits:  r=1,  peak 14651 of 15194 (0.964); with the candidate 2·1 + 15150 = 15152 -> fits.
    v2 = view(
        worker("p", Role.PREFILL),
        worker("d_over", Role.DECODE, busy(9, 1600)),
        worker("d_fails", Role.DECODE, busy(1, 14_500)),
        worker("d_fits", Role.DECODE, busy(1, 14_650, generated=98)),
    )
    assert plan_of(policy().plan(request(PROMPT), v2, 0.0)).decode_worker == "d_fits"


def test_colocates_when_the_transfer_would_break_ttft() -> None:
    def cluster(bandwidth: float):
        return view(
            worker("p", Role.PREFILL, bandwidth=bandwidth),
            worker("d", Role.DECODE, busy(10, 100), bandwidth=bandwidth),
            worker("m", Role.MIXED, busy(10, 100)),
        )

    pol = policy(colocate_roles=(Role.MIXED,))
    # Fast link: disaggregated TTFT 0.111 s beats colocated 0.06 + 10 stalled × 0.06.
    fast = plan_of(pol.plan(request(PROMPT), cluster(1e9), 0.0))
    assert (fast.prefill_worker, fast.decode_worker) == ("p", "d")
    # 10 MB/s: 5e7 bytes take 5 s > the 1 s TTFT target; only colocated meets it.
    slow = plan_of(pol.plan(request(PROMPT), cluster(1e7), 0.0))
    assert slow.colocated and slow.prefill_worker == "m"
    assert slow.predicted_ttft_s == pytest.approx(prefill_s(PROMPT))


def test_colocates_on_an_idle_decode_worker_when_cheaper() -> None:
    pol = policy(colocate_roles=(Role.MIXED, Role.DECODE))
    idle = view(worker("p", Role.PREFILL), worker("d", Role.DECODE))
    plan = plan_of(pol.plan(request(PROMPT), idle, 0.0))
    assert plan.colocated and plan.prefill_worker == "d"  # 0.06 s < 0.111 s
    loaded = view(worker("p", Role.PREFILL), worker("d", Role.DECODE, busy(4, 100)))
    plan = plan_of(pol.plan(request(PROMPT), loaded, 0.0))
    assert plan.decode_worker == "d" and not plan.colocated  # 0.06 + 4 × 0.06 > 0.111


def test_holds_while_ttft_is_reachable_then_rejects() -> None:
    v = view(worker("p", Role.PREFILL), worker("d", Role.DECODE, busy(10, 1500)))
    pol = policy(max_hold_s=0.5)
    held = pol.plan(request(PROMPT, arrival_s=10.0), v, 10.0)
    assert isinstance(held, Reject) and held.hold
    assert held.retry_after_s < 1.0
    # 0.95 s in, 0.05 s of budget is left and the best TTFT is 0.06 s: reject now.
    late = pol.plan(request(PROMPT, arrival_s=10.0), v, 10.95)
    assert isinstance(late, Reject) and not late.hold
    # A longer TTFT target keeps it reachable, but the hold is capped at max_hold_s.
    patient = policy(max_hold_s=0.5, default_slo=SLO_DEFAULT.__class__(10.0, 0.02))
    assert patient.plan(request(PROMPT, arrival_s=10.0), v, 10.4).hold  # type: ignore[union-attr]
    capped = patient.plan(request(PROMPT, arrival_s=10.0), v, 10.6)
    assert isinstance(capped, Reject) and not capped.hold


def test_batch_is_shed_before_interactive() -> None:
    # Peak 8·99 + 12800 = 13592: under 0.95·16000 but over batch's 0.8·16000.
    v = view(worker("p", Role.PREFILL), worker("d", Role.DECODE, busy(8, 1600)))
    pol = policy()
    assert isinstance(pol.plan(request(100), v, 0.0), Plan)
    shed = pol.plan(request(100, priority=Priority.BATCH), v, 0.0)
    assert isinstance(shed, Reject) and not shed.hold
    # Batch also keeps 20 % headroom on TTFT: 0.81 + 0.02 + 0.011 s fits 1 s but not 0.8 s.
    q = view(
        worker("p", Role.PREFILL, short_tokens=8000, short_requests=1), worker("d", Role.DECODE)
    )
    assert isinstance(pol.plan(request(100, priority=Priority.INTERACTIVE), q, 0.0), Plan)
    assert isinstance(pol.plan(request(100, priority=Priority.BATCH), q, 0.0), Reject)


def test_uses_each_workers_prefix_hit() -> None:
    hashes = tuple(range(64))  # 64 blocks of 16 = 1024 cached tokens of 1100
    v = view(
        worker(
            "p_cached", Role.PREFILL, short_tokens=300, short_requests=1, digest=frozenset(hashes)
        ),
        worker("p_idle", Role.PREFILL),
        worker("d", Role.DECODE),
    )
    pol = policy()
    # p_cached: 0.04 s wait + prefill(76) = 0.0576 s; p_idle: prefill(1100) = 0.12 s.
    plan = plan_of(pol.plan(request(1100, prefix_hashes=hashes), v, 0.0))
    assert plan.prefill_worker == "p_cached"
    assert plan.length_class is LengthClass.SHORT
    # Without the hashes every worker prefills all 1100 tokens: the idle one wins.
    assert plan_of(pol.plan(request(1100), v, 0.0)).prefill_worker == "p_idle"


def test_refits_a_worker_from_its_telemetry() -> None:
    pol = policy()
    p1, p2, d = worker("p1", Role.PREFILL), worker("p2", Role.PREFILL), worker("d", Role.DECODE)
    assert plan_of(pol.plan(request(PROMPT), view(p1, p2, d), 0.0)).prefill_worker == "p1"
    slow_steps = tuple(
        StepSample(5 * prefill_s(n), n, 0, 0, end_s=float(k))
        for k, n in enumerate(range(100, 1700, 100))
    )
    p1_slow = worker("p1", Role.PREFILL, steps=slow_steps)
    assert plan_of(pol.plan(request(PROMPT), view(p1_slow, p2, d), 0.0)).prefill_worker == "p2"
    # 16 noiseless steps and the profile as a prior: the curve is learnt to within 10 %.
    assert pol.cost_model("p1").prefill_s(PROMPT) == pytest.approx(5 * prefill_s(PROMPT), rel=0.1)


def test_ignores_dead_and_draining_workers() -> None:
    v = view(
        worker("p_dead", Role.PREFILL, alive=False),
        worker("p_drain", Role.PREFILL, draining=True),
        worker("p", Role.PREFILL, short_tokens=3000, short_requests=1),
        worker("d_dead", Role.DECODE, alive=False),
        worker("d", Role.DECODE, busy(3, 100)),
    )
    plan = plan_of(policy().plan(request(PROMPT), v, 0.0))
    assert (plan.prefill_worker, plan.decode_worker) == ("p", "d")
    gone = view(worker("p", Role.PREFILL), worker("d", Role.DECODE, alive=False))
    result = policy().plan(request(PROMPT), gone, 0.0)
    assert isinstance(result, Reject) and result.reason == "no live worker"


# -- against a brute-force search -----------------------------------------------------


def _exact_peak(held: list[float], remaining: list[int]) -> float:
    return max(
        (
            sum(c + t for c, r in zip(held, remaining) if r >= t)
            for t in range(max(remaining, default=0) + 1)
        ),
        default=0.0,
    )


_running = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(0, 99), st.integers(0, 1500)), max_size=8
)


@settings(max_examples=120, deadline=None)
@given(
    queues=st.lists(st.integers(0, 12_000), min_size=1, max_size=3),
    decoders=st.lists(st.tuples(_running, st.integers(1, 1500)), min_size=1, max_size=4),
    prompt=st.integers(1, 4000),
    max_tokens=st.integers(1, 2000),
)
def test_never_picks_an_infeasible_pair_while_a_feasible_one_exists(
    queues, decoders, prompt, max_tokens
) -> None:
    prefill = [
        worker(f"p{i}", Role.PREFILL, short_tokens=q, short_requests=int(q > 0))
        for i, q in enumerate(queues)
    ]
    decode, facts = [], {}
    for j, (reqs, spare_blocks) in enumerate(decoders):
        running = tuple(RunningRequest(c, g, g + 1 + extra) for c, g, extra in reqs)
        held = [float(r.num_tokens_held) for r in running]
        total = math.ceil(sum(held) / 16) + spare_blocks
        w = worker(f"d{j}", Role.DECODE, running, total_blocks=total)
        decode.append(w)
        remaining = [max(0, min(OUTPUT_LEN, r.max_tokens) - r.num_generated - 1) for r in running]
        r_q = max(0, min(OUTPUT_LEN, max_tokens) - 1)
        other = (w.num_total_blocks - w.num_free_blocks) * 16 - sum(held)
        limit = 0.95 * total * 16 - other
        peak0 = _exact_peak(held, remaining)
        new_peak = _exact_peak([*held, float(prompt)], [*remaining, r_q])
        tpot = 0.01 + 1e-4 * (len(running) + 1) + 1e-7 * (sum(held) + prompt)
        assume(abs(new_peak - limit) > 1e-6 and abs(tpot - 0.02) > 1e-12)
        facts[w.worker_id] = (
            new_peak < limit and tpot <= 0.02,
            peak0 / limit if limit > 0 else math.inf,
        )
    ttft = (
        min(0.01 * (q > 0) + 1e-4 * q for q in queues) + prefill_s(prompt) + prompt * 1e-4 + 0.001
    )
    assume(abs(ttft - 1.0) > 1e-9)
    feasible = {d for d, (ok, _) in facts.items() if ok and ttft <= 1.0}
    event(f"{len(feasible)} of {len(facts)} decode workers feasible")

    result = policy().plan(request(prompt, max_tokens=max_tokens), view(*prefill, *decode), 0.0)
    if not feasible:
        assert isinstance(result, Reject)
        return
    plan = plan_of(result)
    assert plan.decode_worker in feasible
    assert facts[plan.decode_worker][1] == pytest.approx(min(facts[d][1] for d in feasible))
    assert plan.predicted_ttft_s == pytest.approx(ttft)


def test_finished_lengths_in_the_view_replace_the_pessimistic_prior() -> None:
    # Prior: 1000 output tokens each. 12 running × (1000 held + 999 to go) cannot fit 16000.
    d = worker("d", Role.DECODE, busy(12, 1000, max_tokens=2000))
    pol = policy(prior_output_len=1000)
    cold = pol.plan(request(PROMPT), view(worker("p", Role.PREFILL), d), 0.0)
    assert isinstance(cold, Reject)
    # 300 finished requests of 20 tokens push the prior out of the window: r = 19.
    warm_view = view(
        worker("p", Role.PREFILL), worker("d", Role.DECODE, busy(12, 1000, max_tokens=2000))
    )
    warm_view = type(warm_view)(workers=warm_view.workers, recent_output_lens=(20,) * 300)
    assert plan_of(pol.plan(request(PROMPT), warm_view, 0.0)).decode_worker == "d"


def test_colocated_prefill_is_priced_in_chunks_and_its_stall_spread_over_the_outputs() -> None:
    # A 10 MB/s link breaks TTFT for the disaggregated plan, so only colocation on
    # the MIXED worker (10 running sequences of 100 tokens) could serve the request.
    def cluster(budget_tokens: int):
        mixed = replace(worker("m", Role.MIXED, busy(10, 100)), prefill_budget_tokens=budget_tokens)
        return view(
            worker("p", Role.PREFILL, bandwidth=1e7),
            worker("d", Role.DECODE, busy(10, 100), bandwidth=1e7),
            mixed,
        )

    pol = policy(colocate_roles=(Role.MIXED,))
    # 64-token steps: 53 prefill tokens ride each step, which lasts 0.0112 + 0.0053 s;
    # the prompt takes ⌈500 / 54⌉ steps of 0.0111 s overhead each.
    plan = plan_of(pol.plan(request(PROMPT), cluster(64), 0.0))
    assert plan.colocated and plan.prefill_worker == "m"
    step_s = 0.01 + 1e-4 * 10 + 1e-7 * 1000
    assert plan.predicted_ttft_s == pytest.approx(step_s + PROMPT * (1e-4 + step_s / 54))
    assert plan.predicted_ttft_s > 2 * prefill_s(PROMPT)  # not priced as a prefill worker
    # 512-token steps carry ~500 prefill tokens: one step 50 ms longer than the 20 ms
    # TPOT. But TPOT is a mean: each running sequence absorbs that stall once over its
    # ~100 output tokens, 0.5 ms a token, so the mean step stays within target.
    plan = plan_of(pol.plan(request(PROMPT), cluster(512), 0.0))
    assert plan.colocated
    with_request_s = 0.01 + 1e-4 * 11 + 1e-7 * (1000 + PROMPT)
    assert plan.predicted_tpot_s == pytest.approx(with_request_s + 1e-4 * PROMPT / OUTPUT_LEN)
    # Outputs of 5 tokens spread it over 5: 10 ms a token on a 11.25 ms step passes
    # the target, so colocation is refused and nothing is feasible.
    short = policy(colocate_roles=(Role.MIXED,), prior_output_len=5)
    assert isinstance(short.plan(request(PROMPT), cluster(512), 0.0), Reject)


def test_a_fitted_negative_prefill_slope_never_prices_a_chunk_below_the_decode_step() -> None:
    # Steps seen on m where the longer prefill ran faster (a loaded CPU) once fitted a
    # negative per-token slope; priced with it, a 500-token chunk would shorten m's steps
    # and colocation would look cheaper for the running sequences than not prefilling.
    # The fit is non-negative now (test_cost_model), so the slope is set as it came out.
    pol = policy(colocate_roles=(Role.MIXED,))
    model = pol.cost_model("m")
    p, d = model.prefill_coeffs, model.decode_coeffs
    model._set_theta(np.array([0.02, -3e-5, p.c, d.a, d.b, d.c]))
    assert pol.cost_model("m").prefill_coeffs.b < 0
    mixed = replace(worker("m", Role.MIXED, busy(10, 100)), prefill_budget_tokens=512)
    v = view(
        worker("p", Role.PREFILL, bandwidth=1e7),
        worker("d", Role.DECODE, busy(10, 100), bandwidth=1e7),
        mixed,
    )
    plan = plan_of(pol.plan(request(PROMPT), v, 0.0))
    assert plan.colocated
    assert plan.predicted_tpot_s >= 0.01 + 1e-4 * 11 + 1e-7 * (1000 + PROMPT)
