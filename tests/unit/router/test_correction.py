"""router.correction: per-worker bias and scale learned online from observed outcomes."""

from __future__ import annotations

import pytest

from router.correction import Correction, CorrectionSettings, Outcome, OutcomeCorrector


def outcome(worker: str, predicted: float, observed: float) -> Outcome:
    return Outcome(worker, worker, predicted, observed, predicted / 10, observed / 10)


def test_learns_bias_and_scale_of_a_slow_worker_and_leaves_the_others() -> None:
    c = OutcomeCorrector()
    for i in range(16):
        predicted = 0.1 + 0.02 * i
        c.observe(outcome("slow", predicted, 0.05 + 2.0 * predicted))
        c.observe(outcome("true", predicted, predicted))
    fit = c.ttft_fit("slow")
    assert fit.scale == pytest.approx(2.0) and fit.bias_s == pytest.approx(0.05)
    assert c.ttft_s("slow", 0.3) == pytest.approx(0.65)
    assert c.tpot_s("slow", 0.03) == pytest.approx(0.065)
    assert c.ttft_s("true", 0.3) == pytest.approx(0.3)
    assert c.ttft_s("never-seen", 0.3) == 0.3


def test_too_few_samples_change_nothing() -> None:
    c = OutcomeCorrector(CorrectionSettings(min_samples=4))
    for _ in range(3):
        c.observe(outcome("w", 0.1, 1.0))
    assert c.ttft_s("w", 0.1) == 0.1
    c.observe(outcome("w", 0.1, 1.0))
    assert c.ttft_s("w", 0.1) == pytest.approx(1.0)  # constant predictions: a pure bias


def test_a_short_window_follows_a_change_of_speed() -> None:
    c = Correction(CorrectionSettings(window=8))
    for i in range(8):
        c.observe(0.1 + 0.01 * i, 3 * (0.1 + 0.01 * i))  # slow ...
    assert c.fit.apply(0.15) == pytest.approx(0.45)
    for i in range(8):
        c.observe(0.1 + 0.01 * i, 0.1 + 0.01 * i)  # ... then back to the profile's speed
    assert c.fit.apply(0.15) == pytest.approx(0.15)


def test_a_scale_is_not_extrapolated_past_the_predictions_it_was_fitted_on() -> None:
    """A fresh cluster, measured live: a young cost model's first predictions, then its
    grown ones (the prompts admitted at those took at most 5.2 s)."""
    c = Correction(CorrectionSettings())
    for predicted, observed in ((0.19, 1.65), (0.38, 3.2), (0.58, 3.99), (0.8, 4.81)):
        c.observe(predicted, observed)
    fit = c.fit
    assert fit.scale == pytest.approx(5.0, abs=0.05)  # within: the fit itself
    assert fit.apply(0.5) == pytest.approx(fit.bias_s + fit.scale * 0.5)
    # Past them, the error at 0.8 s (4.2 s) is carried: 7.2 s, not 16 s (past a
    # 9.8 s target: refused).
    assert fit.apply(3.0) == pytest.approx(fit.apply(0.8) + 2.2)
    assert fit.apply(3.0) < 9.8 < fit.bias_s + fit.scale * 3.0
    assert fit.apply(0.1) == pytest.approx(fit.apply(0.19) - 0.09)  # below, the same


def test_scale_is_clamped_against_outliers() -> None:
    s = CorrectionSettings(max_scale=8.0)
    c = Correction(s)
    for i, observed in enumerate((0.0, 0.0, 0.0, 100.0)):
        c.observe(0.1 + 0.1 * i, observed)
    assert c.fit.scale == s.max_scale


def test_forget_drops_what_a_worker_taught() -> None:
    c = OutcomeCorrector()
    for _ in range(8):
        c.observe(outcome("w", 0.1, 0.5))
    c.forget("w")
    assert c.ttft_s("w", 0.1) == 0.1


def test_what_a_worker_taught_ages_out_when_read_with_the_time() -> None:
    c = OutcomeCorrector(CorrectionSettings(max_age_s=10.0))
    for i in range(8):  # a slow spell at t = 0..7 s: 3x the predictions
        p = 0.1 + 0.01 * i
        c.observe(Outcome("w", "w", p, 3 * p, p, 3 * p, at_s=float(i)))
    assert c.ttft_s("w", 0.15, now_s=8.0) == pytest.approx(0.45)
    assert c.tpot_s("w", 0.15, now_s=8.0) == pytest.approx(0.45)
    assert c.ttft_s("w", 0.15, now_s=13.5) == pytest.approx(0.45)  # 4 pairs left (t >= 3.5)
    assert c.ttft_s("w", 0.15, now_s=18.0) == 0.15  # all older than 10 s: forgotten
    assert c.ttft_s("w", 0.15) == 0.15  # and they stay forgotten
