"""router.refusals: overload that admission keeps out of the queues reaches the planner."""

from __future__ import annotations

import pytest

from router.planner import RolePressure
from router.refusals import RefusalMeter

QUIET = RolePressure(0.1, 1.0, 0.2, 0.01, 0.05)


def test_refusals_for_a_role_raise_only_that_roles_pressure() -> None:
    meter = RefusalMeter(window_s=10.0)
    for i in range(8):
        meter.placed(float(i))
    meter.refused(8.0, "ttft target unreachable")
    meter.refused(9.0, "predicted ttft miss")
    raised = meter.raise_pressure(QUIET)
    assert raised.prefill == pytest.approx(1.2)  # a fifth refused for TTFT
    assert raised.decode == QUIET.decode


def test_decode_reasons_raise_decode_and_old_decisions_leave_the_window() -> None:
    meter = RefusalMeter(window_s=5.0)
    meter.refused(0.0, "no decode capacity within memory and tpot")
    meter.placed(1.0)
    assert meter.raise_pressure(QUIET).decode == pytest.approx(1.5)
    meter.placed(10.0)  # the refusal at 0 s is out of the window now
    assert meter.raise_pressure(QUIET) == QUIET


def test_refusals_age_out_with_time_when_no_traffic_follows() -> None:
    meter = RefusalMeter(window_s=5.0)
    meter.refused(0.0, "predicted ttft miss")
    assert meter.raise_pressure(QUIET, now_s=4.0).prefill == pytest.approx(2.0)
    assert meter.raise_pressure(QUIET, now_s=6.0) == QUIET  # traffic stopped: nothing refused
