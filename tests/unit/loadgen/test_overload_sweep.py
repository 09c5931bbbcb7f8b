"""The climbing sweep of ``loadgen.overload``: it stops one run past a server's knee,
whatever the server's speed, and the saturation rate is read off the runs it made."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from loadgen import overload
from loadgen.client import BenchConfig, BenchResult
from loadgen.metrics import GoodputSLO, RequestRecord
from loadgen.overload import OverloadConfig, next_sweep_rate, refine_rate, saturation_rate
from loadgen.scenario import WorkloadConfig


def climb(
    goodput_of: Callable[[float], float], start: float = 1.0, max_runs: int = 10
) -> list[dict[str, float]]:
    sweep: list[dict[str, float]] = []
    rate: float | None = start
    while rate is not None:
        goodput = goodput_of(rate)
        sweep.append({"rate": rate, "window_goodput": goodput, "slo_attainment": goodput / rate})
        rate = next_sweep_rate(sweep, 1.5, max_runs)
    return sweep


@pytest.mark.parametrize(("capacity", "start"), [(2.0, 1.0), (7.0, 1.0), (40.0, 4.0)])
def test_the_sweep_ends_one_run_past_the_knee_of_a_server_of_any_speed(
    capacity: float, start: float
) -> None:
    sweep = climb(lambda rate: min(rate, capacity), start)
    rates = [row["rate"] for row in sweep]
    assert rates[-1] >= capacity / 0.9  # it ends on a run short of its rate
    assert sum(rate > capacity for rate in rates) <= 2  # and climbs at most one run past
    # The highest rate of the sweep still served at 90% attainment.
    assert capacity / 1.5 < saturation_rate(sweep) <= capacity / 0.9


def test_a_server_that_still_gains_from_more_traffic_is_climbed_further() -> None:
    # Past 4 req/s, 80% of each further request is served, up to 10 req/s: at 11.4 req/s
    # goodput (9.9) is short of the rate but still rising, so the sweep goes on.
    sweep = climb(lambda rate: min(rate, 4.0 + 0.8 * max(0.0, rate - 4.0), 10.0))
    assert [round(row["window_goodput"], 2) for row in sweep][-3:] == [6.88, 9.91, 10.0]


def test_a_collapsing_server_stops_the_sweep_at_its_first_fall() -> None:
    sweep = climb(lambda rate: rate if rate <= 5.0 else max(0.0, 10.0 - rate))
    assert [row["rate"] for row in sweep][-1] == pytest.approx(7.59375)
    assert saturation_rate(sweep) == pytest.approx(5.0625)  # its goodput 4.94, the peak


def test_the_saturation_rate_is_the_last_served_at_90_percent_not_where_goodput_peaks() -> None:
    """Past the knee admission refuses the excess and goodput still creeps up (live, 2
    AVX2 cores: 3.05 req/s good at 3.4 offered, 4.1 at 7.6): the saturation rate is
    the knee, so 3x of it is not 3x of a rate already twice past it."""
    sweep = [
        {"rate": 2.25, "window_goodput": 2.2, "slo_attainment": 0.98},
        {"rate": 3.375, "window_goodput": 3.05, "slo_attainment": 0.90},
        {"rate": 5.06, "window_goodput": 3.7, "slo_attainment": 0.73},
        {"rate": 7.59, "window_goodput": 4.1, "slo_attainment": 0.54},
        {"rate": 11.39, "window_goodput": 3.7, "slo_attainment": 0.32},
    ]
    assert saturation_rate(sweep) == 3.375
    # A run past the knee that happens to reach 90% again does not move it on.
    sweep.insert(3, {"rate": 6.0, "window_goodput": 5.4, "slo_attainment": 0.91})
    assert saturation_rate(sweep) == 3.375
    assert saturation_rate(sweep[2:]) == 5.06  # none served: the first rate


def test_refining_halves_the_gap_above_the_last_rate_served_in_log_scale() -> None:
    def rows(*attainments: float) -> list[dict[str, float]]:
        rates = (2.25, 3.375, 5.0625, 7.59375)
        return [{"rate": r, "slo_attainment": a} for r, a in zip(rates, attainments)]

    # Served up to 3.375, short at 5.06: their geometric mean.
    assert refine_rate(rows(1.0, 0.95, 0.81, 0.6)) == pytest.approx(4.1335, abs=1e-4)
    # A later run back at 90% does not move the gap (as it does not move saturation).
    assert refine_rate(rows(1.0, 0.7, 0.92, 0.6)) == pytest.approx(math.sqrt(2.25 * 3.375))
    assert refine_rate(rows(0.8, 0.7, 0.6, 0.5)) is None  # nothing served: no gap
    assert refine_rate(rows(1.0, 1.0, 0.95, 0.91)) is None  # all served: no upper end


@pytest.mark.parametrize("capacity", [2.0, 3.0, 4.4, 7.0])
def test_refined_runs_put_the_saturation_rate_within_11_percent_of_the_knee(
    monkeypatch: pytest.MonkeyPatch, capacity: float
) -> None:
    """A server serving ``capacity`` good req/s keeps 90% up to capacity / 0.9: the climb
    alone may stop up to 1.5x below that; two refining runs, 1.5^(1/4) (11%)."""
    knee = capacity / 0.9
    refined = {}
    for steps in (0, 2):
        server = FakeServer(capacity=capacity, cold_share=1.0)
        monkeypatch.setattr(overload, "run_bench", server)
        result = overload.run_overload(fake_config(refine_steps=steps))
        rates = [row["rate"] for row in result["sweep"]]
        assert rates == sorted(rates)  # refining runs take their place in the sweep
        assert [row["phase"] for row in result["sweep"]].count("refine") == steps
        refined[steps] = result["saturation_rate"]
        assert result["over"][0]["rate"] == pytest.approx(2 * refined[steps])
    assert knee / 1.5 < refined[0] <= refined[2] <= knee
    assert refined[2] > knee / 1.5**0.25


def test_a_first_run_already_past_saturation_ends_the_sweep() -> None:
    assert len(climb(lambda rate: 0.5, start=4.0)) == 1


def test_the_sweep_stops_at_its_run_limit() -> None:
    assert len(climb(lambda rate: rate, max_runs=4)) == 4


class FakeServer:
    """``run_bench`` for ``run_overload``: serves ``min(rate, capacity)`` good requests
    per second, but a cold one (its first run) only ``cold_share`` of them, and the first
    run at a rate in ``lucky`` that many times them."""

    def __init__(
        self, capacity: float, cold_share: float = 0.5, lucky: dict[float, float] | None = None
    ) -> None:
        self.capacity = capacity
        self.cold_share = cold_share
        self.lucky = dict(lucky or {})
        self.rates: list[float] = []
        self.seeds: list[int] = []  # each run's workload seed
        self.collector_on: list[bool] = []  # during each run

    def __call__(self, bench: BenchConfig) -> BenchResult:
        self.collector_on.append(gc.isenabled())
        rate, window_s = bench.rate.start_rps, bench.workload.duration_s
        good = min(rate, self.capacity) * (self.cold_share if not self.rates else 1.0)
        good *= self.lucky.pop(rate, 1.0)
        self.rates.append(rate)
        self.seeds.append(bench.workload.seed)
        records = [
            RequestRecord(f"r{i}", True, i / good, ttft_s=0.1, e2el_s=0.2, output_tokens=1)
            for i in range(round(good * window_s))
        ]
        return BenchResult({"slo_attainment": good / rate}, records)


def fake_config(**overrides: Any) -> OverloadConfig:
    """The overload run against a ``FakeServer``: 10 s windows, no settling."""
    settings: dict[str, Any] = {"duration_s": 10.0, "settle_s": 0.0} | overrides
    return OverloadConfig("http://fake", WorkloadConfig(), GoodputSLO(ttft_ms=1000), **settings)


@pytest.mark.parametrize("warm_up_rate", [0.0, 1.0])
def test_a_warm_up_run_keeps_a_cold_server_out_of_the_sweep(
    monkeypatch: pytest.MonkeyPatch, warm_up_rate: float
) -> None:
    server = FakeServer(capacity=3.0)
    monkeypatch.setattr(overload, "run_bench", server)
    config = fake_config(warm_up_rate=warm_up_rate, warm_up_s=5.0)
    result = overload.run_overload(config)
    if not warm_up_rate:  # cold, the first run looks past saturation and ends the sweep
        assert [row["rate"] for row in result["sweep"]] == [1.0]
        # its one run, then the same rate warm: the peak is the warm run's
        assert result["peak_goodput"] == pytest.approx(1.0)
        return
    assert server.rates[0] == warm_up_rate  # the warm-up ran first, and is not counted
    assert [row["rate"] for row in result["sweep"]] == [1.0, 1.5, 2.25, 3.375, 5.0625]
    assert result["peak_goodput"] == pytest.approx(3.0)
    assert result["saturation_rate"] == pytest.approx(2.25)  # 3.375 kept only 89%


def test_the_peak_is_a_second_run_at_the_best_run_s_rate_not_the_best_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run that read high by chance is not the peak the overloaded runs are held to,
    nor a part of it: the sweep picked it for reading high."""
    server = FakeServer(capacity=3.0, cold_share=1.0, lucky={5.0625: 1.2})
    monkeypatch.setattr(overload, "run_bench", server)
    config = fake_config()
    result = overload.run_overload(config)
    assert [row["rate"] for row in result["sweep"]] == [1.0, 1.5, 2.25, 3.375, 5.0625, 7.59375]
    assert result["peak"]["rate"] == 5.0625  # the lucky run's rate, run again
    assert result["sweep"][4]["window_goodput"] == pytest.approx(3.6)  # the lucky run
    assert result["peak_goodput"] == pytest.approx(3.0)
    assert [row["of_peak"] for row in result["over"]] == pytest.approx([1.0] * 2)


def test_each_run_is_timed_with_the_client_s_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collection in the load client lands inside the latencies it times (refusals are
    held to 50 ms): each run goes without one, and the collector is back on after."""
    server = FakeServer(capacity=3.0, cold_share=1.0)
    monkeypatch.setattr(overload, "run_bench", server)
    config = fake_config()
    assert gc.isenabled()
    overload.run_overload(config)
    assert len(server.collector_on) >= 4 and not any(server.collector_on)
    assert gc.isenabled()
    # A run long enough for its garbage to matter keeps the collector on.
    monkeypatch.setattr(overload, "_PAUSE_MAX_REQUESTS", 20)
    server = FakeServer(capacity=3.0, cold_share=1.0)
    monkeypatch.setattr(overload, "run_bench", server)
    overload.run_overload(config)
    assert server.collector_on == [rate * 10.0 > 20 for rate in server.rates]
    assert any(server.collector_on) and not all(server.collector_on)


def test_repeated_runs_go_in_rounds_and_each_factor_is_the_mean_of_its_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One run past saturation swings by a tenth or more: with ``repeats`` the peak's
    rate and each factor run that many times, in rounds, and each is read as a mean."""
    # Capacity 3: the sweep saturates at 2.25 req/s (3.375 keeps 89%), so 2x is 4.5 and
    # 3x 6.75; the first run at 4.5 reads 1.5x, the first at 6.75 0.6x.
    server = FakeServer(capacity=3.0, cold_share=1.0, lucky={4.5: 1.5, 6.75: 0.6})
    monkeypatch.setattr(overload, "run_bench", server)
    config = fake_config(repeats=3)
    result = overload.run_overload(config)
    sweep = [row["rate"] for row in result["sweep"]]
    assert server.rates[len(sweep) :] == [3.375, 4.5, 6.75] * 3  # peak, 2x, 3x; in rounds
    assert result["peak"]["runs"] == pytest.approx([3.0] * 3)
    assert result["peak_goodput"] == pytest.approx(3.0)  # its 3 runs again
    two, three = result["over"]
    assert two["runs"] == pytest.approx([4.5, 3.0, 3.0])
    assert two["window_goodput"] == pytest.approx(3.5)
    assert two["of_peak"] == pytest.approx(3.5 / 3.0)
    assert three["runs"] == pytest.approx([1.8, 3.0, 3.0])
    assert three["of_peak"] == pytest.approx(2.6 / 3.0)


def test_each_round_runs_on_arrivals_of_its_own_and_none_on_the_sweep_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's arrivals follow from its seed and rate: runs again on the best run's
    arrivals would repeat the easy trace the sweep picked it for."""
    server = FakeServer(capacity=3.0, cold_share=1.0)
    monkeypatch.setattr(overload, "run_bench", server)
    config = fake_config(repeats=3, warm_up_rate=1.0, refine_steps=1)
    config = replace(config, workload=replace(config.workload, seed=7))
    result = overload.run_overload(config)
    sweep_runs = 1 + len(result["sweep"])  # the warm-up, the climb and the refining run
    assert server.seeds[:sweep_runs] == [7] * sweep_runs
    assert server.seeds[sweep_runs:] == [8, 8, 8, 9, 9, 9, 10, 10, 10]  # peak, 2x, 3x a round
    assert [row["seed"] for row in result["sweep"]] == [7] * len(result["sweep"])


def test_combined_runs_sum_their_counts_and_keep_the_slowest_refusal() -> None:
    def row(goodput: float, rejected: int, max_ms: float, errors: dict[str, int]) -> dict:
        return {
            "phase": "3x",
            "rate": 9.0,
            "window_goodput": goodput,
            "slo_attainment": goodput / 9.0,
            "completed": 100,
            "rejected": rejected,
            "failed": rejected,
            "max_rejection_ms": max_ms,
            "p99_rejection_ms": max_ms / 2,
            "median_ttft_ms": None,
            "errors": errors,
        }

    combined = overload.combine_runs(
        [row(6.0, 10, 12.0, {"429": 10}), row(5.0, 20, 31.0, {"429": 19, "400": 1})]
    )
    assert combined["runs"] == [6.0, 5.0]
    assert combined["window_goodput"] == pytest.approx(5.5)
    assert (combined["completed"], combined["rejected"], combined["failed"]) == (200, 30, 30)
    assert combined["max_rejection_ms"] == 31.0
    assert combined["p99_rejection_ms"] == 15.5
    assert combined["errors"] == {"429": 29, "400": 1}
    assert combined["median_ttft_ms"] is None


def test_repeats_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="repeats: want at least 1 run, got 0"):
        fake_config(repeats=0)
    with pytest.raises(ValueError, match="refine_steps: want 0 or more runs, got -1"):
        fake_config(refine_steps=-1)
