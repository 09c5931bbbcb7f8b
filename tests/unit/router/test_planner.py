"""P/D ratio planner: sizing by hand, flips with hysteresis and one per interval, the CLI."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest

from router import cli_plan
from router.planner import Flip, RatioPlanner, RolePressure
from router.pool_sizing import WorkloadStats, plan_pools, size_pools
from router.profile import save_profile
from router.types import SLO
from tests.unit.router.builders import PROFILE

WORKLOAD = WorkloadStats(mean_prompt_tokens=1000, mean_output_tokens=100)


def test_sizing_by_hand() -> None:
    # Prefill D = 0.11 s: 20/s × 0.11 / 0.8 -> 3 workers; M/D/1 at 6.67/s each:
    # 0.11 + 6.67·0.0121 / (2·0.267) = 0.261 s, plus 0.101 s transfer.
    # Decode: memory caps B at ⌊15200 / 1100⌋ = 13 (TPOT would allow 48);
    # step 0.01 + 13·(1e-4 + 1050e-7) = 0.012665 s; 20·100·0.012665 / 13 -> 2 workers.
    plan = plan_pools(20.0, PROFILE, WORKLOAD, SLO(ttft_s=1.0, tpot_s=0.02))
    assert (plan.num_prefill, plan.num_decode) == (3, 2)
    assert plan.predicted_ttft_s == pytest.approx(
        0.11 + 20 / 3 * 0.0121 / (2 * (1 - 20 / 3 * 0.11)) + 0.101
    )
    assert plan.decode_batch == 13
    assert plan.decode_step_s == pytest.approx(0.012665)


def test_tighter_ttft_needs_more_prefill_and_tighter_tpot_smaller_batches() -> None:
    assert size_pools(20.0, PROFILE, WORKLOAD, SLO(ttft_s=0.3, tpot_s=0.02)) == (4, 2)
    # TPOT 0.0115 s: 0.01 + B·2.05e-4 <= 0.0115 -> B = 7; 20·100·0.011435/7 -> 4 workers.
    plan = plan_pools(20.0, PROFILE, WORKLOAD, SLO(ttft_s=1.0, tpot_s=0.0115))
    assert (plan.decode_batch, plan.num_decode) == (7, 4)


def test_prefix_hits_shrink_the_prefill_pool() -> None:
    cached = WorkloadStats(1000, 100, mean_prefix_hit_tokens=900)  # D = 0.02 s
    assert size_pools(20.0, PROFILE, cached, SLO(1.0, 0.02))[0] == 1


def _pressure(ttft_ratio: float, decode_ratio: float) -> RolePressure:
    return RolePressure(ttft_ratio, 1.0, decode_ratio, 0.0, 1.0)


def test_flip_toward_the_pressed_role_once_per_interval() -> None:
    planner = RatioPlanner(interval_s=10.0, hysteresis=0.1, min_dwell_s=10.0)
    # Prefill at 1.5× its target, decode at 0.3: moving one of 4 decoders helps.
    assert planner.decide(0.0, _pressure(1.5, 0.3), 2, 4) is Flip.DECODE_TO_PREFILL
    assert planner.decide(5.0, _pressure(1.5, 0.3), 3, 3) is Flip.NONE  # same interval
    assert planner.decide(10.0, _pressure(0.2, 1.4), 3, 3) is Flip.PREFILL_TO_DECODE


def test_no_flip_undoes_the_last_one_within_the_dwell() -> None:
    planner = RatioPlanner(interval_s=1.0, hysteresis=0.1, min_dwell_s=10.0)
    assert planner.decide(0.0, _pressure(1.5, 0.3), 2, 4) is Flip.DECODE_TO_PREFILL
    # Two seconds on, the new prefill worker has emptied the queues it was moved for
    # and decode looks pressed: moving another worker back would undo it.
    assert planner.decide(2.0, _pressure(0.2, 1.4), 3, 3) is Flip.NONE
    assert planner.decide(3.0, _pressure(1.5, 0.3), 3, 3) is Flip.DECODE_TO_PREFILL  # onward
    assert planner.decide(12.0, _pressure(0.2, 1.4), 4, 2) is Flip.NONE  # 9 s since
    assert planner.decide(13.0, _pressure(0.2, 1.4), 4, 2) is Flip.PREFILL_TO_DECODE


def test_no_flip_inside_the_hysteresis_band_or_that_empties_a_pool() -> None:
    planner = RatioPlanner(hysteresis=0.1)
    # 0.9 vs 0.8 on 4+4: after a flip max(0.72, 1.07) is worse; pooled 0.85 is not enough.
    assert planner.decide(0.0, _pressure(0.9, 0.8), 4, 4) is Flip.NONE
    # 1+1: the lone decode worker is not given to prefill; it becomes mixed (it still
    # decodes, and prefills too).
    assert planner.decide(0.0, _pressure(3.0, 0.1), 1, 1) is Flip.DECODE_TO_MIXED


def _mixed(p: float, d: float, mixed_ttft: float, mixed_tpot: float) -> RolePressure:
    return RolePressure(p, 1.0, d, 0.0, 1.0, mixed_ttft_s=mixed_ttft, mixed_tpot_s=mixed_tpot)


def test_two_workers_move_from_1p1d_to_two_mixed_and_back() -> None:
    planner = RatioPlanner(interval_s=1.0, hysteresis=0.1, min_dwell_s=1.0)
    # Decode-heavy on 1P+1D: the idle prefill worker joins decoding first ...
    assert planner.decide(0.0, _mixed(0.2, 2.0, 0.0, 0.0), 1, 1) is Flip.PREFILL_TO_MIXED
    # ... then, the mixed one having room, the decode worker pools with it: 2 mixed.
    assert planner.decide(1.0, _mixed(0.0, 2.0, 0.3, 0.3), 0, 1, 1) is Flip.DECODE_TO_MIXED
    # Chunked prefills now break TPOT on the mixed workers: one goes back to decode ...
    assert planner.decide(2.0, _mixed(0.0, 0.0, 0.5, 1.6), 0, 0, 2) is Flip.MIXED_TO_DECODE
    # ... and the other to prefill (to decode would leave nothing that prefills): 1P+1D.
    assert planner.decide(3.0, _mixed(0.0, 0.3, 0.5, 1.5), 0, 1, 1) is Flip.MIXED_TO_PREFILL
    # Mixed workers within their targets stay mixed.
    assert planner.decide(4.0, _mixed(0.0, 0.0, 0.9, 0.95), 0, 0, 2) is Flip.NONE


def test_long_prompts_overloading_two_mixed_workers_never_unpool_them() -> None:
    planner = RatioPlanner(interval_s=1.0, hysteresis=0.1, min_dwell_s=1.0)
    # TTFT misses on 2 mixed workers: no dedicated role would prefill more.
    assert planner.decide(0.0, _mixed(0.0, 0.0, 2.5, 0.6), 0, 0, 2) is Flip.NONE
    # A TPOT miss, but one prefilling worker fewer would put TTFT at 1.8: worse.
    assert planner.decide(1.0, _mixed(0.0, 0.0, 0.9, 1.3), 0, 0, 2) is Flip.NONE
    # 1P+1M, the prefill worker just emptied, the mixed one missing TTFT: the mixed one
    # is not sent to decode (the prompts would queue on one worker), the pool forms.
    assert planner.decide(2.0, _mixed(0.1, 0.0, 1.6, 0.5), 1, 0, 1) is Flip.PREFILL_TO_MIXED


def test_a_flipped_worker_dwells_in_its_role() -> None:
    from router.planner import choose_flip
    from router.types import Role
    from tests.unit.router.builders import view, worker

    planner = RatioPlanner(interval_s=1.0, hysteresis=0.1, min_dwell_s=10.0)
    cluster = view(worker("p", Role.PREFILL), worker("d", Role.DECODE))
    flip = choose_flip(cluster, _mixed(3.0, 0.1, 0.0, 0.0), planner, 0.0)
    assert flip is not None and (flip.worker_id, flip.target) == ("d", Role.MIXED)
    flipped = view(worker("p", Role.PREFILL), worker("d", Role.MIXED))
    # The planner would send "d" back at once (mixed misses TPOT): it dwells 10 s first.
    back = _mixed(0.1, 0.0, 0.2, 2.0)
    assert choose_flip(flipped, back, planner, 5.0) is None
    flip = choose_flip(flipped, back, planner, 11.0)
    assert flip is not None and (flip.worker_id, flip.target) == ("d", Role.DECODE)


def test_a_worker_that_refused_a_role_is_not_asked_again_and_the_flip_counts_for_nothing() -> None:
    from router.planner import choose_flip
    from router.types import Role
    from tests.unit.router.builders import view, worker

    planner = RatioPlanner(interval_s=1.0, hysteresis=0.1, min_dwell_s=10.0)
    cluster = view(
        worker("p0", Role.PREFILL),
        worker("p1", Role.PREFILL, short_tokens=100, short_requests=1),  # busier
        worker("d0", Role.DECODE),
        worker("d1", Role.DECODE),
    )
    decode_pressed = _pressure(0.2, 1.4)
    flip = choose_flip(cluster, decode_pressed, planner, 0.0)
    assert flip is not None and (flip.worker_id, flip.target) == ("p0", Role.DECODE)
    planner.refused("p0", Role.DECODE)  # a fixed-role worker kept its role
    # Not an interval's wait, and not p0 again: the busier p1 goes instead.
    flip = choose_flip(cluster, decode_pressed, planner, 0.5)
    assert flip is not None and (flip.worker_id, flip.target) == ("p1", Role.DECODE)
    planner.refused("p1", Role.DECODE)
    # No prefill worker takes decode: nothing flips, and that blocks no other flip.
    assert choose_flip(cluster, decode_pressed, planner, 2.0) is None
    flip = choose_flip(cluster, _pressure(1.5, 0.3), planner, 2.0)
    assert flip is not None and flip.target is Role.PREFILL


def test_cli_prints_the_plan(tmp_path, capsys) -> None:
    path = tmp_path / "p.json"
    save_profile(PROFILE, path)
    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    args = parser.parse_args(
        [
            "--rate",
            "20",
            "--profile",
            str(path),
            "--prompt-tokens",
            "1000",
            "--output-tokens",
            "100",
            "--ttft-ms",
            "1000",
            "--tpot-ms",
            "20",
        ]
    )
    assert cli_plan.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_prefill"], out["num_decode"]) == (3, 2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rate", "0"], "--rate must be a number above 0, got 0"),
        (["--rate", "nan"], "--rate must be a number above 0, got nan"),
        (["--rate", "5", "--tpot-ms", "-1"], "--tpot-ms must be a number above 0"),
        (["--rate", "5", "--utilization", "1"], "--utilization must be between 0 and 1"),
        (["--rate", "5", "--prefix-hit-tokens", "1024"], "below --prompt-tokens (1024)"),
        (["--rate", "5", "--profile", "{missing}"], "missing.json: No such file"),
        (["--rate", "5", "--profile", "{text}"], "text.json: not a profile JSON"),
        (["--rate", "5", "--profile", "{partial}"], "missing field 'hardware'"),
    ],
)
def test_cli_refuses_bad_input_in_one_line_naming_the_flag(
    tmp_path, capsys, argv: list[str], says: str
) -> None:
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "partial.json").write_text('{"model": "m"}')
    files = {name: str(tmp_path / f"{name}.json") for name in ("missing", "text", "partial")}
    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    args = parser.parse_args([a.format(**files) for a in argv])
    assert cli_plan.run(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("baton plan: "), captured
    assert says in captured.err and len(captured.err.splitlines()) == 1, captured.err


def test_pressure_from_a_view_drives_the_flip() -> None:
    from router.types import Role
    from tests.unit.router.builders import busy, policy, view, worker

    pol = policy()
    # Two prefill workers with 8000 queued tokens each: 0.81 s wait + 0.11 s for a
    # 1000-token prompt = 0.92 of the 1 s target. Four near-idle decoders at 0.51.
    # A flip: max(0.92·2/3, 0.51·4/3) = 0.68 < 0.92 - 0.05.
    prefill = [worker(f"p{i}", Role.PREFILL, short_tokens=8000, short_requests=1) for i in range(2)]
    decode = [worker(f"d{i}", Role.DECODE, busy(1, 100)) for i in range(4)]
    pressure = pol.pressure(view(*prefill, *decode), mean_prompt_tokens=1000)
    assert pressure.prefill == pytest.approx(0.92)
    assert pressure.decode == pytest.approx((0.01 + 2e-4 + 1e-5) / 0.02)  # TPOT dominates
    assert RatioPlanner(hysteresis=0.05).decide(0.0, pressure, 2, 4) is Flip.DECODE_TO_PREFILL


def test_encode_pressure_moves_a_worker_between_the_encode_and_prefill_pools() -> None:
    planner = RatioPlanner(interval_s=10.0, hysteresis=0.1, min_dwell_s=10.0)
    # Encode queues at 1.2 of the TTFT target, prefill at 0.3, decode at 0.3: one of
    # the 4 prefill workers encodes: max(1.2·2/3, 0.3·4/3) = 0.8 < 1.2 - 0.1.
    swamped = replace(_pressure(0.3, 0.3), encode_wait_s=1.2 * 1.0)
    assert planner.decide(0.0, swamped, 4, 4, num_encode=2) is Flip.PREFILL_TO_ENCODE
    # Prefill pressed, encoders idle: one encoder prefills (never the last one).
    idle = replace(_pressure(1.5, 0.3), encode_wait_s=0.0)
    assert planner.decide(10.0, idle, 2, 4, num_encode=2) is Flip.ENCODE_TO_PREFILL
    assert planner.decide(20.0, idle, 2, 4, num_encode=1) is Flip.DECODE_TO_PREFILL
    # Without encode workers the encode term is not looked at.
    assert RatioPlanner().decide(0.0, swamped, 4, 4) is Flip.NONE


def test_encode_pressure_is_the_encode_queue_against_the_ttft_target() -> None:
    from router.types import Role
    from tests.unit.router.builders import policy, view, worker

    pol = policy()  # encode b = 1e-5 s per image token; TTFT target 1 s
    encoders = [worker(f"e{i}", Role.ENCODE, short_tokens=50_000 * (i + 1)) for i in range(2)]
    v = view(*encoders, worker("p", Role.PREFILL), worker("d", Role.DECODE))
    pressure = pol.pressure(v, mean_prompt_tokens=100)
    assert pressure.encode_wait_s == pytest.approx(1e-5 * 75_000)
    assert pressure.encode == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("slo", "workload", "says"),
    [
        # D = 0.11 s and 0.101 s of transfer: no pool gets a prompt out within 0.2 s.
        (SLO(ttft_s=0.2, tpot_s=0.02), WORKLOAD, ["TTFT target of 200 ms: one prompt"]),
        # A step of one request at 1050 tokens of context: 0.01 + 1e-4 + 1050e-7 s.
        (SLO(ttft_s=1.0, tpot_s=0.01), WORKLOAD, ["TPOT target of 10 ms: a decode step"]),
        # 15000 + 1000 tokens against 0.95 × 16000 = 15200.
        (SLO(ttft_s=1e3, tpot_s=0.02), WorkloadStats(15000, 1000), ["16000 tokens"]),
    ],
)
def test_a_target_no_pool_meets_is_named_not_sized_for(
    slo: SLO, workload: WorkloadStats, says: list[str]
) -> None:
    plan = plan_pools(20.0, PROFILE, workload, slo)
    assert len(plan.shortfalls) == len(says)
    for shortfall, words in zip(plan.shortfalls, says, strict=True):
        assert words in shortfall
    # An unreachable TTFT does not grow the prefill pool to the cap: the utilisation's.
    assert plan.num_prefill < 100
    assert plan.to_dict()["meets_targets"] is False


@pytest.mark.parametrize("ttft_s", [1.0, 0.25])
def test_a_rate_beyond_the_most_workers_is_named_and_predicted_at_the_cap(ttft_s: float) -> None:
    # 20 000/s × 0.11 s / 0.8 needs 2750 prefill workers, and (as in the sizing by hand)
    # 20 000 × 100 × 0.012665 / 13 -> 1949 decode workers; the cap is 1000. At 2750 the
    # TTFT would be 0.43 s, over a 0.25 s target; at the cap the queue only grows, which
    # the first shortfall says: nothing is predicted at a size that is not planned.
    slo = SLO(ttft_s=ttft_s, tpot_s=0.02)
    plan = plan_pools(20_000.0, PROFILE, WORKLOAD, slo, max_workers=1000)
    assert plan.shortfalls == (
        "the rate needs 2750 prefill workers, more than the most planned (1000)",
        "the rate needs 1949 decode workers, more than the most planned (1000)",
    )
    assert (plan.num_prefill, plan.num_decode) == (1000, 1000)
    assert plan.predicted_ttft_s == math.inf  # 20 req/s per worker of 0.11 s each
    assert plan.to_dict()["predicted_ttft_s"] is None


def test_the_cli_says_what_cannot_be_met_and_exits_1(capsys) -> None:
    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    assert cli_plan.run(parser.parse_args(["--rate", "10", "--tpot-ms", "1"])) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["shortfalls"] == [
        captured.err.removeprefix("baton plan: ").strip()
    ]
    assert "TPOT target of 1 ms" in captured.err
    assert cli_plan.run(parser.parse_args(["--rate", "10"])) == 0
    assert json.loads(capsys.readouterr().out)["meets_targets"] is True
