"""``baton profile`` recovers known cost curves from a scripted server over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.cli_profile import fit_nonnegative, fit_robust
from loadgen.sim.profile import load_profile
from services.cli import main

from .sse_server import Timing, serve


def test_fit_nonnegative_drops_negative_terms() -> None:
    n = np.array([1.0, 2.0, 3.0, 4.0])
    x = np.stack([np.ones_like(n), n, n * n], axis=1)
    assert fit_nonnegative(x, 0.5 + 0.25 * n) == pytest.approx([0.5, 0.25, 0.0], abs=1e-9)
    # A decreasing curve cannot use a negative slope: the slope is dropped.
    coeffs = fit_nonnegative(x[:, :2], 1.0 - 0.1 * n)
    assert coeffs[1] == 0.0 and coeffs[0] > 0


def test_fit_robust_ignores_one_stall() -> None:
    b = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    x = np.stack([np.ones_like(b), b], axis=1)
    t = 0.004 + 0.0005 * b
    t[1] = 0.14  # one probe stalled
    assert fit_robust(x, t) == pytest.approx([0.004, 0.0005], rel=1e-6)
    assert fit_nonnegative(x, t)[0] > 0.02  # the plain fit is dragged off


def test_profile_measures_prefill_and_decode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timing = Timing(first_s=0.01, first_per_prompt_char_s=5e-4, gap_s=0.01, gap_per_stream_s=0.004)
    out = tmp_path / "p.json"
    # No idle before a probe (--idle-s 0), and each probe's median of 2: on this 2-core host
    # a probe after 0.2-1 s of quiet waited 30-60 ms more to be answered than one sent at
    # once (the scripted server's delays do not model that), which moved the fitted TTFT at
    # 400 tokens past the 25% bound; with repeats 1, one slow probe did the same.
    with serve(timing) as url:
        argv = [
            "profile",
            "--base-url",
            url,
            "--prefill-lens",
            "10,200,400",
            "--repeats",
            "2",
            "--idle-s",
            "0",
            "--decode-batches",
            "1,4",
            "--decode-contexts",
            "16,32",
            "--decode-tokens",
            "8",
            "--hardware",
            "test box",
            "--out",
            str(out),
        ]
        assert main(argv) == 0
    data = json.loads(out.read_text())
    profile = load_profile(out)  # the router's loader accepts it
    assert profile.hardware == "test box" and data["estimated"] is False

    # TTFT = 0.01 + 5e-4 per prompt character (plus HTTP overhead): the fitted
    # curve predicts it (the split between b and c is not identifiable from noise).
    def prefill_s(n: int) -> float:
        p = profile.prefill
        return p.a + p.b * n + p.c * n * n

    assert prefill_s(400) == pytest.approx(0.01 + 0.2, rel=0.25)
    assert prefill_s(800) == pytest.approx(0.01 + 0.4, rel=0.25)
    # Gaps grow with the number of concurrent streams: a positive per-sequence term.
    assert profile.decode.b + profile.decode.c * 20 > 0.001
    assert any("measured by `baton profile`" in s for s in profile.sources)
    # Progress on stderr, a line per prompt length and per decode probe, as measured.
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [
        "prefill 1/3",
        "prefill 2/3",
        "prefill 3/3",
        "decode 1/4",
        "decode 2/4",
        "decode 3/4",
        "decode 4/4",
    ], lines
    assert lines[2].startswith("baton profile: prefill 3/3: 400 tokens, median TTFT ")

    # The summary on stdout says what the coefficients are in.
    summary = json.loads(captured.out)
    assert summary["units"]["prefill"] == {"a": "s", "b": "s/token", "c": "s/token²"}
    assert summary["units"]["decode"]["b"] == "s/request"
    assert summary["prefill"] == data["prefill"] and summary["out"] == str(out)


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--prefill-lens", "16,abc", "whole numbers, comma-separated, of prompt lengths"),
        ("--prefill-lens", "0,16,64", "each at least 1"),
        ("--prefill-lens", "16,16,64", "at least 3 different prompt lengths"),
        ("--decode-batches", "1,-2", "each at least 1"),
        ("--decode-contexts", "64", "at least 2 different prompt lengths"),
        ("--repeats", "0", "a whole number of repeats, at least 1"),
        ("--decode-tokens", "3,4", "a whole number of output tokens"),
        ("--idle-s", "-1", "want seconds, 0 or more"),
    ],
)
def test_a_bad_probe_flag_is_refused_before_any_probe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, said: str
) -> None:
    """Each was taken before: a 0 or negative batch ran every prefill probe, then failed
    with 'no median for empty data'; one prompt length wrote a profile fitted to a point."""
    with serve(Timing()) as url, pytest.raises(SystemExit) as exit_info:
        main(["profile", "--base-url", url, "--out", str(tmp_path / "p.json"), flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and said in err, err
    assert not (tmp_path / "p.json").exists()


def test_a_missing_base_profile_fails_before_the_probes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was read after every probe had run (minutes on a real server), then failed."""
    missing = tmp_path / "nope" / "base.json"
    argv = ["profile", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json")]
    assert main([*argv, "--base-profile", str(missing)]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "prefill 1/" not in err, err
