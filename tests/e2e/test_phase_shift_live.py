"""Rebalancing live: a 1 prefill + 1 decode ``baton serve`` (Ray actors, a random
15M-parameter Llama) offered a prefill-heavy phase (long prompts, a few output tokens),
then a decode-heavy one (short prompts, long outputs), then prefill-heavy again, with
the ratio planner on (a short interval).

Workers flip both ways: a worker gains prefill work (decode -> prefill or mixed,
mixed -> prefill) and a worker gains decode work (prefill -> decode or mixed, mixed ->
decode). A 2-worker cluster can only move between 1 prefill + 1 decode and 2 mixed
workers (the planner never empties a role): measured, it pools them in the first
prefill-heavy phase (decode -> mixed, prefill -> mixed).

Whether that serves more than the fixed split is measured, not asserted here (the
simulator's phase shift: ``make bench-policies``; this server and SLO are
``benchmarks/overload.py``'s). On 2 AVX-512 cores the planned run served 329-342 of
360 good against 275-276 on the fixed split (three runs, and CI). On 2 AVX2 cores,
scaled (below), 125 of 159 against 132: the second prefill-heavy phase loses (31
against 44 good), because the spatial split keeps one of the two mixed workers for
short prompts until their decayed share of requests falls under 5%, 58 long requests
after the decode-heavy phase, longer than the phase. Letting a class that stopped
coming go at once (a class unseen for 6-10 of its mean gaps) won here (142-151 against
117-132) but let long prompts onto the short prompts' worker in
``tests/integration/test_router_live.py`` (2 runs of 4), so it is not in.

The scenario is sized for a host that prefills one prefill-heavy prompt in about
``REF_PREFILL_S`` (2 AVX-512 cores). On a slower host (measured first, in this process)
the offered rate is divided by the slowdown and both targets multiplied by it, so the
pressure on each role is the same in units of the host's own speed: on 2 AVX2 cores a
1500-token prompt took 1.3 s, and at the unscaled 6 req/s both runs served almost nothing
(26 and 29 of 360 good)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
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

PHASE_S = 20.0  # seconds of arrivals per phase (on a slower host up to 2x, see Scale)
PREFILL_HEAVY = WorkloadConfig(input_len="uniform:1200-1800", output_len="8", seed=1)
DECODE_HEAVY = WorkloadConfig(input_len="uniform:32-64", output_len="160", seed=2)
RATE = 6.0  # requests/s in every phase, on the reference host
PHASES = (("prefill-heavy", PREFILL_HEAVY), ("decode-heavy", DECODE_HEAVY))
REF_PREFILL_S = 0.25  # one 1500-token prefill of the model, alone, on the reference host
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


@dataclass(frozen=True)
class Scale:
    """The scenario on this host: ``slowdown`` >= 1 against the reference host."""

    slowdown: float

    @property
    def rate(self) -> float:
        return RATE / self.slowdown

    @property
    def phase_s(self) -> float:  # longer phases keep enough requests in each
        return PHASE_S * min(self.slowdown, 2.0)

    def slo(self, bench: ModuleType) -> Any:
        """Both targets: a mixed worker's step that prefills a chunk beside the decodes
        takes the host's prefill speed too (unscaled, on 2 AVX2 cores 27 of the pooled
        run's 106 prefill-heavy requests missed their TPOT)."""
        slo = bench.SLO
        return replace(
            slo, ttft_ms=slo.ttft_ms * self.slowdown, tpot_ms=slo.tpot_ms * self.slowdown
        )


def measure_scale(model: Path) -> Scale:
    """The median of three 1500-token prefills of ``model`` in this process, one thread,
    against ``REF_PREFILL_S``."""
    import time

    import numpy as np
    import torch

    from services.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.loader import load_model
    from services.engine.messages import EngineRequest, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(load_model(str(model)), EngineConfig(device="cpu"))
        took = []
        for k in range(4):  # the first warms up
            ids = np.random.default_rng(k).integers(3, 4000, 1500)
            engine.add_request(
                EngineRequest(f"c{k}", tuple(map(int, ids)), SamplingParams(max_tokens=1))
            )
            start = time.process_time()
            while engine.has_unfinished():
                engine.step()
            took.append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    return Scale(max(1.0, statistics.median(took[1:]) / REF_PREFILL_S))


def run_phases(bench: ModuleType, model: Path, work: Path, scale: Scale) -> dict[str, Any]:
    config = bench.serve_config("slo_goodput", True, 0.0)
    slo = scale.slo(bench)
    config["router"]["default_slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
    config["workers"] = {"mode": "disaggregated", "prefill": 1, "decode": 1}
    config["engine"]["max_model_len"] = 2048
    config["router"]["rebalance_interval_s"] = INTERVAL_S
    path = work / "phases.yaml"
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
        base = BenchConfig(url, tokenizer=tokenizer, slo=slo)
        for name, workload in (*PHASES, PHASES[0]):
            phase = replace(workload, duration_s=scale.phase_s)
            result = run_bench(replace(base, workload=phase, rate=RateSpec(scale.rate)))
            phase_good = sum(1 for r in result.records if slo.is_good(r))
            good += phase_good
            by_phase.append((name, phase_good, len(result.records)))
            seen.append(flips(url))
    finally:
        stop(proc, grace_s=60)
    return {"good": good, "phases": by_phase, "flips": seen, "slowdown": scale.slowdown}


@pytest.mark.timeout(600)  # up to 3 phases of 40 s, plus the server's start
def test_flips_go_both_ways_under_a_phase_shift(tmp_path: Path) -> None:
    bench = load_script(ROOT / "benchmarks/overload.py", "overload_bench")
    model = bench.save_small_llama(tmp_path / "small-llama")
    planned = run_phases(bench, model, tmp_path, measure_scale(model))
    final = planned["flips"][-1]
    assert final["toward prefill"] >= 1 and final["toward decode"] >= 1, planned
