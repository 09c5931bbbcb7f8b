"""``benchmarks/overload.py``'s first sweep rate: ``auto`` follows the host's speed, a
rate given is kept, and a rate that is not one is refused by name; the refusal bound
follows the host's speed as the SLO does, never below the issue's 50 ms."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]
overload = load_script(ROOT / "benchmarks" / "overload.py", "bench_overload_args_test")


def test_auto_starts_where_the_reference_hosts_climb_from_one_reached_after_three_runs() -> None:
    args = overload.parser().parse_args([])
    assert args.start_rate == "auto"
    assert overload.first_sweep_rate(args.start_rate, 1.0) == pytest.approx(1.5**3)
    # A host three times slower saturates at a third of the rate: it starts at a third.
    assert overload.first_sweep_rate(args.start_rate, 3.0) == pytest.approx(1.5**3 / 3)


def test_a_rate_given_is_kept_whatever_the_host() -> None:
    args = overload.parser().parse_args(["--start-rate", "2.5"])
    assert overload.first_sweep_rate(args.start_rate, 4.0) == 2.5


def test_the_refusal_bound_is_50_ms_scaled_by_a_slower_host_only() -> None:
    assert overload.refusal_bound_ms(1.0) == 50.0
    assert overload.refusal_bound_ms(1.5) == pytest.approx(75.0)
    assert overload.refusal_bound_ms(0.8) == 50.0  # a faster host is held to 50 ms


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "fast"])
def test_a_start_rate_that_is_not_a_rate_is_refused_naming_the_option(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        overload.parser().parse_args(["--start-rate", text])
    assert exit_info.value.code == 2
    assert "--start-rate" in capsys.readouterr().err


def test_two_refining_runs_by_default_and_a_count_out_of_range_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert overload.parser().parse_args([]).refine_steps == 2
    assert overload.parser().parse_args(["--refine-steps", "0"]).refine_steps == 0
    with pytest.raises(SystemExit):
        overload.parser().parse_args(["--refine-steps", "-1"])
    assert "--refine-steps" in capsys.readouterr().err
