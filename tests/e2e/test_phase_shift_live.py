"""Rebalancing live: a 1 prefill + 1 decode ``baton serve`` (Ray actors, a random
15M-parameter Llama) offered a prefill-heavy phase (long prompts, a few output tokens),
then a decode-heavy one (short prompts, long outputs), then prefill-heavy again, once
with the ratio planner on (a short interval) and once with it off, in this test.

With it on, workers flip both ways: a worker gains prefill work (decode -> prefill or
mixed, mixed -> prefill) and a worker gains decode work (prefill -> decode or mixed,
mixed -> decode); and more requests meet their SLO over the whole run than on the fixed
split. A 2-worker cluster can only move between 1 prefill + 1 decode and 2 mixed workers
(the planner never empties a role): measured, it pools them in the first prefill-heavy
phase (decode -> mixed, prefill -> mixed) and the mixed pair serves every phase, 329-342
requests good against 275-276 on the fixed split, of 360 (three runs). It runs the
server, workload and SLO of ``benchmarks/overload.py`` (``--phases``)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from loadgen.arrivals import RateSpec
from loadgen.client import BenchConfig, run_bench
from loadgen.scenario import WorkloadConfig
from loadgen.scripts import load_script
from loadgen.server_proc import ROOT, child_env, free_port, stop, wait_until_serving

pytestmark = [pytest.mark.slow]

PHASE_S = 20.0  # seconds of arrivals per phase
PREFILL_HEAVY = WorkloadConfig(input_len="uniform:1200-1800", output_len="8", seed=1)
DECODE_HEAVY = WorkloadConfig(input_len="uniform:32-64", output_len="160", seed=2)
PHASES = (("prefill-heavy", PREFILL_HEAVY, 6.0), ("decode-heavy", DECODE_HEAVY, 6.0))
INTERVAL_S = 2.0  # router.rebalance_interval_s with the planner on
_FLIP = re.compile(r'baton_role_changes_total\{from_role="(\w+)",to_role="(\w+)"\} (\S+)')


def flips(url: str) -> Counter[str]:
    """Role flips so far by direction: toward prefill or toward decode capacity."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    directions: Counter[str] = Counter()
    for source, target, count in _FLIP.findall(text):
        if target == "prefill" or source == "decode":
            directions["toward prefill"] += int(float(count))
        if target == "decode" or source == "prefill":
            directions["toward decode"] += int(float(count))
    return directions


def run_phases(bench: ModuleType, model: Path, work: Path, rebalance: bool) -> dict[str, Any]:
    config = bench.serve_config("slo_goodput", rebalance, 0.0)
    config["workers"] = {"mode": "disaggregated", "prefill": 1, "decode": 1}
    config["engine"]["max_model_len"] = 2048
    config["router"]["rebalance_interval_s"] = INTERVAL_S if rebalance else 3600.0
    path = work / f"phases-{rebalance}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--config", str(path)]
    cmd += ["--model", str(model), "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    from services.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    good, by_phase, seen = 0, [], []
    try:
        wait_until_serving(url, proc, 300, path="/v1/models", poll_s=1.0)
        base = BenchConfig(url, tokenizer=tokenizer, slo=bench.SLO)
        for name, workload, rate in (*PHASES, PHASES[0]):
            phase = replace(workload, duration_s=PHASE_S)
            result = run_bench(replace(base, workload=phase, rate=RateSpec(rate)))
            phase_good = sum(1 for r in result.records if bench.SLO.is_good(r))
            good += phase_good
            by_phase.append((name, phase_good, len(result.records)))
            seen.append(flips(url))
    finally:
        stop(proc, grace_s=60)
    return {"good": good, "phases": by_phase, "flips": seen}


def test_flips_go_both_ways_and_serve_more_than_a_fixed_split(tmp_path: Path) -> None:
    bench = load_script(ROOT / "benchmarks/overload.py", "overload_bench")
    model = bench.save_small_llama(tmp_path / "small-llama")
    fixed = run_phases(bench, model, tmp_path, rebalance=False)
    planned = run_phases(bench, model, tmp_path, rebalance=True)

    assert sum(fixed["flips"][-1].values()) == 0, fixed
    final = planned["flips"][-1]
    assert final["toward prefill"] >= 1 and final["toward decode"] >= 1, planned
    assert planned["good"] > fixed["good"], (planned, fixed)
