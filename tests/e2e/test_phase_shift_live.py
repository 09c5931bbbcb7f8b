"""Rebalancing live: a 1 prefill + 1 decode ``baton serve`` (Ray actors, a random
15M-parameter Llama) offered a prefill-heavy phase (long prompts, a few output tokens),
then a decode-heavy one (short prompts, long outputs), then prefill-heavy again, with
the ratio planner on (a short interval).

Workers flip both ways: a worker gains prefill work (decode -> prefill or mixed,
mixed -> prefill) and a worker gains decode work (prefill -> decode or mixed, mixed ->
decode). A 2-worker cluster can only move between 1 prefill + 1 decode and 2 mixed
workers (the planner never empties a role): measured, it pools them in the first
prefill-heavy phase (decode -> mixed, prefill -> mixed).

The same phases on the fixed split (the planner off) in the same test: the pooled run
serves more good requests. On 2 AVX-512 cores 329-342 of 360 against 275-276 (three
runs, and CI). On 2 AVX2 cores, scaled (below), 142 and 145 of 159 against 117 and 132,
and 151 of 174 against 129 (slowdown 4.1; 44, 58, 49 good by phase against 33, 58, 38).
Two things had made it lose there (89 against 113): the TPOT target was not scaled
(a mixed worker's step with a prompt chunk in it runs at the host's prefill speed),
and after the decode-heavy phase the spatial split kept one of the two mixed workers
for short prompts through the whole second prefill-heavy phase (31 against 44 good),
until ``LengthClassifier.present_request_shares`` let a class that stopped coming go
(which needs every arrival observed, ``Router.arrive``: see ``test_router_live.py``).
Later it tied or lost in CI (126-126, 114-114, 98-99): in the last the pool went back
to 1+1 inside a prefill-heavy phase, and a fresh cluster's outcome correction could
refuse most of a first phase (3 of 8 fixed runs here). With the planner mended
(``router/planner.py``): 134-112 and 128-113; with flips to mixed undrained and the correction mended too (``router/correction.py``):
122-106 and 120-106 (slowdown 4.4-5.7); with admission's prefill speed taken against
the speed its correction learned at, and its guard forgetting a spell of misses
(``router/admission.py``): 164-141, 144-137 and 162-142 (slowdown 4.1-4.2).

The scenario is sized for a host that prefills one prefill-heavy prompt in about
``loadgen.host_speed.REF_PREFILL_S`` (2 AVX-512 cores). On a slower host (measured
first, in this process) the offered rate is divided by the slowdown and both targets multiplied by it, so the
pressure on each role is the same in units of the host's own speed: on 2 AVX2 cores a
1500-token prompt took 1.3 s, and at the unscaled 6 req/s both runs served almost nothing
(26 and 29 of 360 good)."""

from __future__ import annotations

import re
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
from loadgen.host_speed import measure_slowdown
from loadgen.scenario import WorkloadConfig
from loadgen.scripts import load_script
from loadgen.server_proc import ROOT, start_baton, stop

pytestmark = [pytest.mark.slow]

PHASE_S = 20.0  # seconds of arrivals per phase (on a slower host up to 2x, see Scale)
PREFILL_HEAVY = WorkloadConfig(input_len="uniform:1200-1800", output_len="8", seed=1)
DECODE_HEAVY = WorkloadConfig(input_len="uniform:32-64", output_len="160", seed=2)
RATE = 6.0  # requests/s in every phase, on the reference host
PHASES = (("prefill-heavy", PREFILL_HEAVY), ("decode-heavy", DECODE_HEAVY))
INTERVAL_S = 2.0  # router.rebalance_interval_s with the planner on
FIXED_INTERVAL_S = 3600.0  # ... and off: no interval ends within the run
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
        return bench.SLO.scaled(self.slowdown)


def measure_scale(model: Path) -> Scale:
    """This host against the reference (``loadgen.host_speed``)."""
    return Scale(measure_slowdown(model))


def run_phases(
    bench: ModuleType, model: Path, work: Path, scale: Scale, interval_s: float
) -> dict[str, Any]:
    """The three phases on a fresh server, the ratio planner every ``interval_s``."""
    slo = scale.slo(bench)
    config = bench.serve_config("slo_goodput", True, 0.0, slo)
    config["workers"] = {"mode": "disaggregated", "prefill": 1, "decode": 1}
    config["engine"]["max_model_len"] = 2048
    config["router"]["rebalance_interval_s"] = interval_s
    path = work / f"phases-{interval_s:g}.yaml"
    path.write_text(yaml.safe_dump(config))
    from services.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    good, by_phase, seen = 0, [], []
    args = ["serve", "--config", str(path), "--model", str(model), "--log-level", "warning"]
    proc, url = start_baton(args, timeout_s=300)
    try:
        base = BenchConfig(url, tokenizer=tokenizer, slo=slo)
        for name, workload in (*PHASES, PHASES[0]):
            phase = replace(workload, duration_s=scale.phase_s)
            result = run_bench(replace(base, workload=phase, rate=RateSpec(scale.rate)))
            phase_good = sum(1 for r in result.records if slo.is_good(r))
            refused = sum(1 for r in result.records if r.status == 429)
            good += phase_good
            # (phase, good, sent, refused at the door): the rest were served late
            by_phase.append((name, phase_good, len(result.records), refused))
            seen.append(flips(url))
    finally:
        stop(proc, grace_s=60)
    return {"good": good, "phases": by_phase, "flips": seen, "slowdown": scale.slowdown}


@pytest.mark.timeout(900)  # two servers, each 3 phases of up to 40 s and its start
def test_flips_go_both_ways_and_serve_more_under_a_phase_shift(tmp_path: Path) -> None:
    bench = load_script(ROOT / "benchmarks/overload.py", "overload_bench")
    model = bench.save_small_llama(tmp_path / "small-llama")
    scale = measure_scale(model)
    planned = run_phases(bench, model, tmp_path, scale, INTERVAL_S)
    fixed = run_phases(bench, model, tmp_path, scale, FIXED_INTERVAL_S)
    print({"planned": planned, "fixed": fixed})  # the figures, in the log (-rA)
    final = planned["flips"][-1]
    assert final["toward prefill"] >= 1 and final["toward decode"] >= 1, planned
    assert not fixed["flips"][-1], fixed
    assert planned["good"] > fixed["good"], (planned, fixed)
