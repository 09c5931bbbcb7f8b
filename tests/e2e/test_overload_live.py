"""Goodput past saturation, live: ``baton serve`` with 2 prefill + 2 decode workers (Ray
actors, a random 53M-parameter Llama, the rebalancer off), swept over open-loop rates
to find where it saturates, then offered 2x and 3x that rate, all in this test.

Each run's goodput is the requests sent in its window that met the SLO per second
(``loadgen.overload.window_goodput``). Past saturation the router must refuse what it
cannot serve, so the admitted requests keep their targets: goodput stays within 90% of
the sweep's peak, every refusal is a 429 answered within 50 ms, and nothing fails
otherwise. The router refuses at once (``max_hold_s: 0``): a held request that finds no
room is refused when its TTFT budget runs out, seconds later, by design.

The model is sized so that the engines' compute, not the HTTP work of the load
generator and the gateway (which share the same 2 cores), sets the saturation rate, as
on GPUs: about 9 req/s here. With the 15M-parameter model it was about 30 req/s, and
at 3x the client's and the gateway's 90 req/s took the engines' CPU (0.85-0.92 of
peak). It runs the same server, workload and SLO as ``benchmarks/overload.py``."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any

import pytest
import yaml

from loadgen.arrivals import RateSpec
from loadgen.client import BenchConfig, run_bench
from loadgen.overload import OverloadConfig, run_overload
from loadgen.server_proc import ROOT, child_env, free_port, stop, wait_until_serving
from tests.e2e import overload_bench

pytestmark = [pytest.mark.slow]

RATES = (4.0, 8.0, 12.0, 16.0)  # requests/s; saturation is near 9 on 2 cores
DURATION_S = 20.0  # seconds of arrivals per run, swept and overloaded
WARM_UP_RATE, WARM_UP_S = 4.0, 10.0  # the cost models learn the workers first


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ModuleType, str, Any]]:
    bench = overload_bench.load()
    work = tmp_path_factory.mktemp("overload")
    model = bench.save_medium_llama(work / "medium-llama")
    config = work / "overload.yaml"
    config.write_text(yaml.safe_dump(bench.serve_config("slo_goodput", False, 0.0)))
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--config", str(config)]
    cmd += ["--model", str(model), "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 300, path="/v1/models", poll_s=1.0)
        from services.engine.loader import load_tokenizer

        yield bench, url, load_tokenizer(str(model))
    finally:
        stop(proc, grace_s=60)


def test_goodput_at_2x_and_3x_saturation_holds_90_percent_of_peak_with_quick_refusals(
    served: tuple[ModuleType, str, Any],
) -> None:
    bench, url, tokenizer = served
    base = BenchConfig(url, tokenizer=tokenizer)
    warm = replace(bench.WORKLOAD, duration_s=WARM_UP_S, seed=99)
    run_bench(replace(base, workload=warm, rate=RateSpec(WARM_UP_RATE), slo=bench.SLO))

    config = OverloadConfig(
        url, bench.WORKLOAD, bench.SLO, RATES, (2.0, 3.0), DURATION_S, bench=base
    )
    # The client times each refusal: a full collection of this test session's heap would
    # stall it for tens of milliseconds (baton bench freezes its start-up heap likewise).
    gc.collect()
    gc.freeze()
    try:
        result = run_overload(config)
    finally:
        gc.unfreeze()

    sweep = result["sweep"]
    assert sweep[0]["slo_attainment"] >= 0.95, sweep[0]  # the lowest rate is served
    assert sweep[-1]["window_goodput"] < 0.9 * RATES[-1], sweep  # the sweep passes saturation
    for row in result["over"]:
        assert row["rejected"] > 0, row  # overloaded, and it refuses
        # Every failure is a refusal (429), or the 400 of a prompt past the model's length
        # (the lognormal prompts' tail reaches it now and then at these rates).
        too_long = sum(n for e, n in row["errors"].items() if "maximum context length" in e)
        assert row["failed"] == row["rejected"] + too_long, row
        assert row["of_peak"] >= 0.9, (result["peak_goodput"], result["saturation_rate"], row)
        assert row["max_rejection_ms"] < 50.0, row
