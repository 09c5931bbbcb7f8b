"""``JudgedSpeeds``: the speed a worker's plans were judged at lately, which a learned
TTFT correction already prices."""

from __future__ import annotations

import math

import pytest

from router.live_speed import JudgedSpeeds


def test_the_speed_judged_at_follows_a_lasting_change_over_its_horizon() -> None:
    """A worker judged at 1.0x, then at 2.0x: one horizon later the mean has moved
    1 - 1/e of the way, and a few horizons later it is the new speed. Samples at the
    same instant add nothing; workers are apart; a forgotten worker has none."""
    speeds = JudgedSpeeds(horizon_s=30.0)
    assert speeds.reference("p") == 0.0
    speeds.observe("p", 1.0, 0.0)
    speeds.observe("p", 5.0, 0.0)  # no time has passed: no weight
    assert speeds.reference("p") == 1.0
    for step in range(1, 31):  # one sample a second at 2x
        speeds.observe("p", 2.0, float(step))
    assert speeds.reference("p") == pytest.approx(2.0 - math.exp(-1.0))
    for step in range(31, 181):
        speeds.observe("p", 2.0, float(step))
    assert speeds.reference("p") == pytest.approx(2.0, abs=0.01)
    speeds.observe("q", 1.2, 200.0)
    assert speeds.reference("q") == 1.2
    speeds.forget("p")
    assert speeds.reference("p") == 0.0 and speeds.reference("q") == 1.2
