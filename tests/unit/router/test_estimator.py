"""Past-future estimator: hand-computed peaks, exactness with a one-length history,
monotonicity, the exact candidate insertion, and the engine-facing admission rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.estimator import (
    OutputLengthHistory,
    PastFutureAdmission,
    PastFutureEstimator,
    remaining_tokens,
    sorted_history,
    worst_case_peak,
)
from router.peak_table import PeakTable, peak_per_draw
from router.types import RunningRequest


def _remaining(history: list[int], reqs: list[tuple[int, int, int]], u: list[list[float]]):
    h = np.sort(np.array(history, dtype=np.float64))
    gen = np.array([g for _, g, _ in reqs], dtype=np.float64)
    cap = np.array([m for _, _, m in reqs], dtype=np.float64)
    return remaining_tokens(h, gen, cap, np.array(u, dtype=np.float64))


def _peak(history, reqs, u) -> float:
    held = np.array([c for c, _, _ in reqs], dtype=np.float64)
    return float(peak_per_draw(_remaining(history, reqs, u), held).max())


def _exact_future_peak(held: list[int], remaining: list[int]) -> int:
    """Step through the future: at step t every request with r_i >= t holds c_i + t."""
    horizon = max(remaining, default=0)
    return max(
        (sum(c + t for c, r in zip(held, remaining) if r >= t) for t in range(horizon + 1)),
        default=0,
    )


# -- hand-computed --------------------------------------------------------------------


def test_one_length_history_peak_by_hand() -> None:
    # H = {100}: r = 100 - g - 1 -> 99, 49, 0. Sorted (r, c): (99,10) (49,20) (0,30).
    # Terms: 1*99+10=109, 2*49+30=128, 3*0+60=60 -> 128 (at t=49: 59 + 69).
    reqs = [(10, 0, 1000), (20, 50, 1000), (30, 99, 1000)]
    assert _remaining([100], reqs, [[0.3, 0.6, 0.9]]).tolist() == [[99, 49, 0]]
    assert _peak([100], reqs, [[0.3, 0.6, 0.9]]) == 128


def test_request_that_outran_most_of_history_is_predicted_long() -> None:
    history = [5] * 8 + [200]
    # X has generated 50: only 200 is longer -> L=200, r=149, whatever u.
    # Y (g=0, u=0.5): position 0.5*8 = 4 -> 5, r=4.  Z (g=3, u=0): first entry 5, r=1.
    reqs = [(100, 50, 1000), (40, 0, 1000), (30, 3, 1000)]
    u = [[0.99, 0.5, 0.0]]
    assert _remaining(history, reqs, u).tolist() == [[149, 4, 1]]
    # Terms: 149+100=249, 2*4+140=148, 3*1+170=173 -> X alone at t=149 holds 249.
    assert _peak(history, reqs, u) == 249


def test_cap_interpolation_and_tail_by_hand() -> None:
    # Capped by M: g=50 in H={5..,200} would be 200, M=120 -> 120, r=69.
    assert _remaining([5] * 8 + [200], [(0, 50, 120)], [[0.7]]).tolist() == [[69]]
    # Interpolation: H={10,30}, g=0, u=0.25 -> 15, r=14.
    assert _remaining([10, 30], [(0, 0, 1000)], [[0.25]]).tolist() == [[14]]
    # Outran all of H: uniform between g=50 and M=90; u=0.5 -> 70, r=19.
    assert _remaining([10, 20], [(0, 50, 90)], [[0.5]]).tolist() == [[19]]


def test_largest_peak_over_draws_is_kept() -> None:
    # H={10,30}; one request c=100, g=0. Draw 1 u=0 -> L=10, r=9 -> 109;
    # draw 2 u=0.5 -> L=20, r=19 -> 119.
    assert _peak([10, 30], [(100, 0, 1000)], [[0.0], [0.5]]) == 119


def test_estimator_api_with_one_length_history() -> None:
    history = OutputLengthHistory(prior_output_len=100, num_prior=1)
    est = PastFutureEstimator(history, np.random.default_rng(0))
    running = [RunningRequest(10, 0, 1000), RunningRequest(20, 50, 1000)]
    assert est.peak(running) == 128  # terms 109, 2*49+30=128
    # Candidate with a 5-token prompt, g=0: r=99 -> new terms (99,10),(99,5),(49,20):
    # 109, 2*99+15=213, 3*49+35=182 -> 213.
    assert est.peak_with(running, 5, 1000) == 213
    assert est.admit(running, 5, 1000, capacity_tokens=225)  # 0.95*225 = 213.75
    assert not est.admit(running, 5, 1000, capacity_tokens=224)


def test_prior_washes_out() -> None:
    history = OutputLengthHistory(prior_output_len=1000, window=4, num_prior=2)
    assert history.sorted_lengths().tolist() == [1000, 1000]
    for v in (10, 20, 30, 40):
        history.observe(v)
    assert history.sorted_lengths().tolist() == [10, 20, 30, 40]


# -- properties -----------------------------------------------------------------------

_request = st.tuples(
    st.integers(0, 500),  # c
    st.integers(0, 400),  # g
    st.integers(0, 300),  # extra room above L for M
)


@settings(max_examples=150, deadline=None)
@given(length=st.integers(2, 400), reqs=st.lists(_request, max_size=12), seed=st.integers(0, 99))
def test_one_length_history_gives_the_exact_future_peak(length, reqs, seed) -> None:
    running = [RunningRequest(c, g % length, length + extra) for c, g, extra in reqs]
    history = OutputLengthHistory(length, num_prior=1)
    est = PastFutureEstimator(history, np.random.default_rng(seed))
    held = [r.num_tokens_held for r in running]
    remaining = [length - r.num_generated - 1 for r in running]
    assert est.peak(running) == _exact_future_peak(held, remaining)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=30),
    reqs=st.lists(_request, max_size=12),
    cand=st.tuples(st.integers(0, 500), st.integers(1, 600)),
    seed=st.integers(0, 99),
)
def test_adding_a_request_never_lowers_the_estimate(lengths, reqs, cand, seed) -> None:
    running = [RunningRequest(c, g, g + extra + 1) for c, g, extra in reqs]
    history = OutputLengthHistory(1, num_prior=0, window=64, lengths=lengths)
    before = PastFutureEstimator(history, np.random.default_rng(seed)).peak(running)
    with_q = PastFutureEstimator(history, np.random.default_rng(seed))
    assert with_q.peak_with(running, cand[0], cand[1]) >= before


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(0, 10),
    data=st.data(),
)
def test_peak_table_prices_a_candidate_like_a_full_recount(rows, n, data) -> None:
    ints = st.integers(0, 50)
    remaining = np.array(
        data.draw(st.lists(st.lists(ints, min_size=n, max_size=n), min_size=rows, max_size=rows)),
        dtype=np.float64,
    ).reshape(rows, n)
    held = np.array(data.draw(st.lists(ints, min_size=n, max_size=n)), dtype=np.float64)
    r_q = np.array(data.draw(st.lists(ints, min_size=rows, max_size=rows)), dtype=np.float64)
    c_q = float(data.draw(ints))
    table = PeakTable(remaining, held)
    full = peak_per_draw(
        np.concatenate([remaining, r_q[:, None]], axis=1), np.append(held, c_q)
    ).max()
    assert table.peak_with(c_q, r_q) == pytest.approx(full)
    assert table.peak_tokens == pytest.approx(peak_per_draw(remaining, held).max())


# -- engine admission -----------------------------------------------------------------


def _admission(**kw) -> PastFutureAdmission:
    adm = PastFutureAdmission(prior_output_len=100, num_prior=1, **kw)
    return adm


def test_admission_boundary_and_other_tokens() -> None:
    # Same numbers as the estimator test: peak with the 5-token candidate is 213.
    running = [RunningRequest(10, 0, 1000), RunningRequest(20, 50, 1000)]
    adm = _admission()
    # 15 blocks of 16 = 240 tokens: 0.95*240 = 228 > 213; used = held (30 tokens = 2 blocks).
    assert adm.can_admit(5, 1000, running, 13, 15, 16)
    assert adm.last_peak_tokens == 213
    # Two more used blocks (32 tokens) held by something else: 228 - 32 + 2 = 198 < 213.
    assert not adm.can_admit(5, 1000, running, 11, 15, 16)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), max_size=40),
    reqs=st.lists(_request, min_size=1, max_size=12),
    cand=st.tuples(st.integers(0, 800), st.integers(1, 900)),
    free_blocks=st.integers(0, 400),
    seed=st.integers(0, 99),
)
def test_admission_decides_as_its_draws_would(lengths, reqs, cand, free_blocks, seed) -> None:
    """The worst case bounds every draw's peak, so skipping the draws when it fits never
    changes a decision: each one equals the drawn estimate's (same seed, drawn here)."""
    running = [RunningRequest(c, g, g + extra) for c, g, extra in reqs]
    total_blocks = 400
    adm = PastFutureAdmission(prior_output_len=200, num_prior=4, seed=seed)
    for n in lengths:
        adm.observe_finished(n)
    drawn = PastFutureEstimator(adm.history, np.random.default_rng(seed))
    held = float(sum(r.num_tokens_held for r in running))
    used = (total_blocks - free_blocks) * 16
    limit = drawn.fraction * total_blocks * 16 - max(0.0, used - held)
    peak = drawn.peak_with(running, *cand)
    gen = np.array([r.num_generated for r in running], dtype=np.float64)
    cap = np.array([r.max_tokens for r in running], dtype=np.float64)
    assert worst_case_peak(held, gen, cap, *cand) >= peak
    fits = np.ceil((cand[0] + 1) / 16) <= free_blocks
    assert adm.can_admit(*cand, running, free_blocks, total_blocks, 16) == (fits and peak < limit)


def test_admission_draws_nothing_when_the_worst_case_fits() -> None:
    """A worker far from full: every request at its cap fits, so no draw is made (the
    generator is untouched) and the estimate reported is that worst case."""
    adm = _admission()
    running = [RunningRequest(100, 10, 50), RunningRequest(40, 0, 30)]
    state = adm.estimator.rng.bit_generator.state
    assert adm.can_admit(20, 60, running, 900, 1000, 16)
    assert adm.estimator.rng.bit_generator.state == state
    # held 140 + to go (50-10-1) + (30-0-1) + the candidate's 20 + (60-1)
    assert adm.last_peak_tokens == 140 + 39 + 29 + 20 + 59
    # Fuller: 20 of 30 blocks used, 180 tokens by others: the limit 0.95 * 480 - 180 =
    # 276 is under the worst case (287), so the draws decide (and move the generator).
    adm.can_admit(20, 60, running, 10, 30, 16)
    assert adm.estimator.rng.bit_generator.state != state
    assert adm.last_peak_tokens <= 287


def test_admission_learns_from_finished_requests() -> None:
    adm = PastFutureAdmission(prior_output_len=5000, num_prior=100, window=200)
    running = [RunningRequest(100, 0, 8000) for _ in range(4)]
    assert not adm.can_admit(100, 8000, running, 500, 1000, 16)  # pessimistic prior
    for _ in range(200):
        adm.observe_finished(50)
    assert adm.can_admit(100, 8000, running, 500, 1000, 16)


def test_admission_counts_mispredictions_and_fits_the_engine_protocol() -> None:
    from services.backends.protocol import AdmissionPolicy

    adm = _admission()
    assert isinstance(adm, AdmissionPolicy)
    adm.record_exhaustion()
    adm.record_exhaustion()
    assert adm.num_mispredictions == 2


@pytest.mark.parametrize("num_lengths", [0, 3, 4, 7, 12])
def test_sorted_history_is_the_window_an_output_length_history_holds(num_lengths: int) -> None:
    lengths = [7 * i % 11 + 1 for i in range(num_lengths)]
    expected = OutputLengthHistory(50, window=8, num_prior=4, lengths=lengths).sorted_lengths()
    assert np.array_equal(sorted_history(50, 8, 4, lengths), expected)
