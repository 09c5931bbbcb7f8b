"""The climbing sweep of ``loadgen.overload``: it stops one run past a server's knee,
whatever the server's speed, and the saturation rate is read off the runs it made."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loadgen.overload import next_sweep_rate


def climb(
    goodput_of: Callable[[float], float], start: float = 1.0, max_runs: int = 10
) -> list[dict[str, float]]:
    sweep: list[dict[str, float]] = []
    rate: float | None = start
    while rate is not None:
        sweep.append({"rate": rate, "window_goodput": goodput_of(rate)})
        rate = next_sweep_rate(sweep, 1.5, max_runs)
    return sweep


def saturation(sweep: list[dict[str, float]]) -> float:
    peak = max(row["window_goodput"] for row in sweep)
    return min(row["rate"] for row in sweep if row["window_goodput"] >= 0.95 * peak)


@pytest.mark.parametrize(("capacity", "start"), [(2.0, 1.0), (7.0, 1.0), (40.0, 4.0)])
def test_the_sweep_ends_one_run_past_the_knee_of_a_server_of_any_speed(
    capacity: float, start: float
) -> None:
    sweep = climb(lambda rate: min(rate, capacity), start)
    rates = [row["rate"] for row in sweep]
    assert rates[-1] >= capacity / 0.9  # it ends on a run short of its rate
    assert sum(rate > capacity for rate in rates) <= 2  # and climbs at most one run past
    assert capacity <= saturation(sweep) < 1.5 * capacity


def test_a_server_that_still_gains_from_more_traffic_is_climbed_further() -> None:
    # Past 4 req/s, 80% of each further request is served, up to 10 req/s: at 11.4 req/s
    # goodput (9.9) is short of the rate but still rising, so the sweep goes on.
    sweep = climb(lambda rate: min(rate, 4.0 + 0.8 * max(0.0, rate - 4.0), 10.0))
    assert [round(row["window_goodput"], 2) for row in sweep][-3:] == [6.88, 9.91, 10.0]


def test_a_collapsing_server_stops_the_sweep_at_its_first_fall() -> None:
    sweep = climb(lambda rate: rate if rate <= 5.0 else max(0.0, 10.0 - rate))
    assert [row["rate"] for row in sweep][-1] == pytest.approx(7.59375)
    assert saturation(sweep) == pytest.approx(5.0625)  # its goodput 4.94, the peak


def test_a_first_run_already_past_saturation_ends_the_sweep() -> None:
    assert len(climb(lambda rate: 0.5, start=4.0)) == 1


def test_the_sweep_stops_at_its_run_limit() -> None:
    assert len(climb(lambda rate: rate, max_runs=4)) == 4
