"""The encode term a + b·m, fitted from observed encodes."""

from __future__ import annotations

import pytest

from router.encode_fit import EncodeFit
from router.profile import EncodeCoeffs


def test_distinct_sizes_give_the_least_squares_line() -> None:
    fit = EncodeFit(EncodeCoeffs(a=0.5, b=0.0))
    for m in (100, 200, 400, 800):
        fit.observe(m, 0.003 + 2e-5 * m)
    assert fit.estimate.a == pytest.approx(0.003)
    assert fit.estimate.b == pytest.approx(2e-5)
    assert fit.encode_s(300) == pytest.approx(0.009)


def test_one_size_keeps_the_seeds_fixed_part_and_fits_the_slope() -> None:
    fit = EncodeFit(EncodeCoeffs(a=0.002, b=1.0))
    assert fit.encode_s(576) == pytest.approx(0.002 + 576)  # the seed until a sample
    for duration_s in (0.030, 0.034):
        fit.observe(576, duration_s)
    assert fit.estimate.a == 0.002
    assert fit.encode_s(576) == pytest.approx(0.032)
    assert fit.encode_s(0) == 0.0 and fit.num_samples == 2


def test_nothing_goes_negative() -> None:
    fit = EncodeFit(EncodeCoeffs())
    fit.observe(100, 0.5)
    fit.observe(1000, 0.1)  # bigger and faster: noise, not a negative slope
    assert fit.estimate.b == 0.0 and fit.estimate.a >= 0.0
