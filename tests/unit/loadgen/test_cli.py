"""``baton bench`` / ``baton simulate`` end to end through the real CLI entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main

from .sse_server import MODEL, serve


def test_bench_writes_run_folder_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve() as url:
        common = [
            "bench",
            "--base-url",
            url,
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--num-requests",
            "4",
        ]
        assert (
            main(
                [
                    *common,
                    "--concurrency",
                    "2",
                    "--goodput",
                    "ttft:2000",
                    "--out",
                    str(tmp_path / "a"),
                ]
            )
            == 0
        )
        assert main([*common, "--rate", "50", "--out", str(tmp_path / "b")]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12
    assert summary["slo_attainment"] == 1.0
    lines = (tmp_path / "a" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["output_tokens"] == 3
    assert (tmp_path / "a" / "latency_cdf.png").stat().st_size > 1000
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "completed" in table and "B/A" in table and "1.000" in table  # 4 vs 4 completed


def test_bench_compares_two_sweeps_rate_by_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["bench", "--input-len", "8", "--output-len", "2", "--num-requests", "3"]
    with serve() as url:
        for name, rates in (("a", "20,40"), ("b", "40,80")):
            out = str(tmp_path / name)
            assert main([*common, "--base-url", url, "--rate", rates, "--out", out]) == 0
    capsys.readouterr()
    assert main(["bench", "--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "run-40" in out and "run-20" not in out and "run-80" not in out  # the common rate
    assert "B/A" in out
    # A sweep against one run: a clear exit 2, naming how to pick a sweep's rate.
    run = str(tmp_path / "a" / "run-20")
    assert main(["bench", "--compare", str(tmp_path / "a"), run]) == 2
    assert "SWEEP/run-<rate>" in capsys.readouterr().err
    assert main(["bench", "--compare", run, str(tmp_path / "b" / "run-80")]) == 0


def test_bench_takes_a_client_s_base_url_and_refuses_a_model_not_served(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serve() as url:  # http://127.0.0.1:PORT
        common = ["bench", "--num-requests", "2", "--input-len", "4", "--output-len", "2", "--json"]
        # The OpenAI client's base_url (…/v1) and a bare host:port mean the server.
        for base in (f"{url}/v1", f"{url}/v1/", url.removeprefix("http://")):
            assert main([*common, "--base-url", base]) == 0, capsys.readouterr().err
            assert json.loads(capsys.readouterr().out)["completed"] == 2
        # A --model the server does not list: exit 2 before any request, naming both.
        assert main([*common, "--base-url", url, "--model", "nope"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == f"baton bench: {url} does not serve 'nope'; it serves {MODEL}"


def test_bench_unreachable_server_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-requests", "1"]) == 1
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_bench_images_on_the_completions_endpoint_exit_2_before_any_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Port 9 answers nothing: a request sent would make this exit 1, naming the server.
    argv = ["bench", "--base-url", "http://127.0.0.1:9", "--num-requests", "2"]
    assert main([*argv, "--images-per-request", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "baton bench: image requests need the chat endpoint (--endpoint chat)"
    )


def test_simulate_sweep(tmp_path: Path) -> None:
    argv = [
        "simulate",
        "--prefill",
        "1",
        "--decode",
        "1",
        "--rate",
        "2,8",
        "--num-requests",
        "50",
        "--input-len",
        "uniform:20-200",
        "--output-len",
        "uniform:5-40",
        "--goodput",
        "ttft:500",
        "tpot:100",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["rate"] for s in sweep] == ["2", "8"]
    assert all(s["completed"] + s["failed"] == 50 for s in sweep)
    assert (tmp_path / "attainment_vs_rate.png").exists()
    assert (tmp_path / "run-8" / "summary.json").exists()


def test_bad_flag_values_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--input-len", "uniform:9", "--rate", "1"]) == 2
    assert "LOW-HIGH" in capsys.readouterr().err
    assert main(["simulate", "--goodput", "ttfx:3", "--rate", "1"]) == 2


def test_version_prints_the_installed_package_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"baton {version('baton')}"


def test_bench_and_profile_send_the_key_from_a_file_or_the_environment_never_argv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key.txt"
    key_file.write_text("sk-bench-secret\n")
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with serve(api_key="sk-bench-secret") as url:
        bench = ["bench", "--base-url", url, "--num-requests", "2", "--output-len", "2", "--json"]
        assert main(bench) == 1  # no key: the server's 401 on /v1/models
        assert "401" in capsys.readouterr().err
        assert main([*bench, "--api-key-file", str(key_file)]) == 0
        assert json.loads(capsys.readouterr().out)["completed"] == 2
        for variable in ("BATON_API_KEY", "OPENAI_API_KEY"):
            monkeypatch.setenv(variable, "sk-bench-secret")
            assert main(bench) == 0, variable
            monkeypatch.delenv(variable)
        profile = ["profile", "--base-url", url, "--prefill-lens", "4,8,12", "--repeats", "1"]
        profile += ["--decode-batches", "1,2", "--decode-contexts", "4,8", "--decode-tokens", "2"]
        profile += ["--idle-s", "0", "--out", str(tmp_path / "p.json")]
        assert main([*profile, "--api-key-file", str(key_file)]) == 0
        assert main(profile) == 1
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["bench", "--api-key-file", str(empty), "--num-requests", "1"]) == 2
    assert "the file is empty" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "soon"])
def test_bench_timeout_must_be_seconds_above_zero(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--timeout", timeout])
    assert exit_info.value.code == 2
    assert "--timeout: want seconds above 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--encode", "-1"], "--encode must be >= 0, got -1"),
        (["--colocated", "-2"], "--colocated must be >= 0, got -2"),
        (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1, got 0"),
        (["--prefill-budget", "0"], "--prefill-budget must be >= 1, got 0"),
        (["--long-prefill-tokens", "-1"], "--long-prefill-tokens must be >= 0, got -1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--flip-latency", "-1"], "--flip-latency must be >= 0 seconds"),
    ],
)
def test_simulate_refuses_counts_and_sizes_out_of_range(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--prefill", "1", "--decode", "1", "--rate", "5", "--num-requests", "5"]
    assert main([*argv, *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "expected"), [([], 96), (["--long-prefill-tokens", "0"], 0)])
def test_simulate_chunks_prompts_as_the_served_config_says(
    flags: list[str], expected: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engines' long-prefill threshold comes from the same config file as the router's
    # settings; the flag overrides it.
    import loadgen.sim.cli as sim_cli

    served = tmp_path / "serve.json"
    served.write_text(json.dumps({"engine": {"long_prefill_token_threshold": 96}}))
    taken = []
    real = sim_cli.simulate
    monkeypatch.setattr(sim_cli, "simulate", lambda config: taken.append(config) or real(config))
    argv = ["simulate", "--config", str(served), "--rate", "5", "--num-requests", "5"]
    assert main([*argv, *flags]) == 0
    assert [c.long_prefill_tokens for c in taken] == [expected]
