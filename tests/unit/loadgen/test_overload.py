"""Overload through the gateway's router, simulated: past saturation (found by a sweep in
the same test) admission refuses what would miss and goodput holds near its peak."""

from __future__ import annotations

import pytest

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO
from loadgen.scenario import WorkloadConfig
from loadgen.sim import SimConfig, simulate
from loadgen.sim.profile import load_profile
from router.front_door import RouterSettings

pytestmark = [pytest.mark.slow]

SECONDS = 8.0


def goodput_at(rate: float) -> dict[str, float]:
    """2 prefill + 2 decode tiny workers, the issue's mix: lognormal prompts (mean 200), 48
    output tokens, TTFT 2 s / TPOT 200 ms; holds end within 40 ms (a refusal is quick)."""
    config = SimConfig(
        workload=WorkloadConfig(
            input_len="lognormal:mean=200,sigma=0.8",
            output_len="48",
            num_requests=int(rate * SECONDS),
            seed=0,
        ),
        rate=RateSpec(rate),
        num_prefill=2,
        num_decode=2,
        router=RouterSettings(profile=load_profile(), max_hold_s=0.04),
        policy="slo_goodput",
        slo=GoodputSLO(ttft_ms=2000, tpot_ms=200),
        max_tokens=48,
        rebalance=False,
    )
    return simulate(config).summary


def test_goodput_at_2x_and_3x_saturation_stays_within_90_percent_of_peak() -> None:
    sweep = {rate: goodput_at(rate)["request_goodput"] for rate in (40.0, 80.0, 120.0, 160.0)}
    peak = max(sweep.values())
    assert sweep[40.0] > 0.95 * 40.0 and peak < 0.8 * 160.0  # the sweep crosses saturation
    saturation = peak  # the most the cluster serves within its SLOs
    for factor in (2, 3):
        over = goodput_at(factor * saturation)
        assert over["rejected"] > 0  # it is overloaded, and refuses
        assert over["request_goodput"] >= 0.9 * peak, (factor, saturation, peak, over)
