"""Simulator fidelity, live: ``baton profile`` a live tiny cluster, ``baton bench`` it, then
``baton simulate`` the same workload from the profile; p50 TTFT, p50 TPOT, goodput and
throughput of the simulation against live (issue 13's bound: within 20%).

    python benchmarks/fidelity.py [--policies round_robin,slo_goodput] [--rounds 3]
        [--idle-s 0.7] [--rate 1.0]

One JSON object per line: a row per policy (live, simulated, relative error per figure,
whether all are within 20%), then a summary. deploy/configs/local.yaml (1 prefill + 1
decode worker, 1 torch thread each) serves; the simulator's router is built from the
same file's ``router`` section (``RouterSettings.from_config``), and only the simulated
hardware comes from the measured profile.

How each round runs, and why (each cost a bound of 20% on this 2-core VM):

* The profile is measured on a fresh ``--policy round_robin`` server, whose router
  disaggregates every probe; ``slo_goodput`` colocates some probes on the idle decode
  worker, and their hand-off gaps are then no hand-offs.
* The bench runs on a fresh server of the policy under test, and the simulator runs the
  same request stream, so both routers have seen the same requests: after a profile,
  live ``slo_goodput`` disaggregated all 40 requests where the cold simulated router
  colocated 21 (a fresh server colocated 22).
* The first ``WARMUP`` requests of that stream are measured in neither: a fresh server's
  first run is slow (p50 TTFT 9.4 ms against 7.2 ms for the next run of the same
  requests, decode 0.51 against 0.45 ms per token: first calls, allocations).
* Probes wait ``--idle-s`` (stretched at random up to twice) before each, about the
  quiet a request of the bench finds at ``--rate``: measured here after 0.1 s, decode
  steps read 0.67-0.75 ms per token and a 64-token prefill 11.3 ms; after 0.7 s,
  0.40-0.60 ms and 8.9 ms (not known why: sampled per 100 ms, no process of the server
  burns measurable CPU after a request).
* Rounds alternate profile and bench, and the profile is their mean (a prediction is
  linear in the coefficients): the machine runs some 15% faster or slower for tens of
  seconds at a time.

One run of three rounds here (16.5 min, load 1.2): round_robin TTFT -6.6%, TPOT +13.8%;
slo_goodput TTFT -14.5%, TPOT -17.3%; goodput and throughput within 0.03%. Single rounds
swing past 20% (slo_goodput TTFT -18% to -21%, TPOT -4% to -32%).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from loadgen import cli_profile  # noqa: E402
from loadgen.arrivals import RateSpec  # noqa: E402
from loadgen.client import BenchConfig, run_bench  # noqa: E402
from loadgen.metrics import GoodputSLO, RequestRecord, compute_summary  # noqa: E402
from loadgen.scenario import WorkloadConfig  # noqa: E402
from loadgen.server_proc import ROOT, baton_serving  # noqa: E402
from loadgen.sim import SimConfig, simulate  # noqa: E402
from loadgen.sim.profile import Profile, QuadCoeffs  # noqa: E402
from router.front_door import RouterSettings  # noqa: E402
from services.config import load_config  # noqa: E402
from services.heap import freeze_startup_heap  # noqa: E402

CONFIG = ROOT / "deploy/configs/local.yaml"
SLO = GoodputSLO(ttft_ms=400.0, tpot_ms=60.0)
# Light enough that the two workers rarely run at once: on 2 cores they share the cores
# with the gateway and this client, which neither the profile nor the simulator models.
WARMUP, MEASURED = 20, 40  # requests of one stream: the first warm the server, unmeasured
WORKLOAD = WorkloadConfig(
    input_len="uniform:32-512", output_len="uniform:8-64", num_requests=WARMUP + MEASURED, seed=1
)
KEYS = ("median_ttft_ms", "median_tpot_ms", "request_goodput", "request_throughput")
BOUND = 0.2


def measure_profile(url: str, idle_s: float) -> Profile:
    parser = argparse.ArgumentParser()
    cli_profile.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url", url,
            "--prefill-lens", "16,64,128,256,384,512",
            "--decode-batches", "1,2,4",
            "--decode-contexts", "64,256",
            "--decode-tokens", "32",
            "--repeats", "4",
            "--idle-s", str(idle_s),
            "--out", "unused.json",
        ]
    )  # fmt: skip
    return asyncio.run(cli_profile.measure_profile(args))


def mean_profile(profiles: list[Profile]) -> Profile:
    def mean(coeffs: list[QuadCoeffs]) -> QuadCoeffs:
        return QuadCoeffs(*(statistics.fmean(getattr(q, k) for q in coeffs) for k in "abc"))

    latency_s = statistics.fmean(p.transfer.latency_s for p in profiles)
    return replace(
        profiles[0],
        prefill=mean([p.prefill for p in profiles]),
        decode=mean([p.decode for p in profiles]),
        transfer=replace(profiles[0].transfer, latency_s=latency_s),
    )


def measured(records: Sequence[RequestRecord]) -> tuple[list[RequestRecord], float]:
    """The records after the warm-up (by send order) and the seconds from the first of
    them being sent to the last answer."""
    ordered = sorted(records, key=lambda r: r.start_s)[WARMUP:]
    start_s = ordered[0].start_s
    end_s = max(r.start_s + (r.e2el_s or 0.0) for r in ordered)
    return ordered, end_s - start_s


def fidelity(policy: str, rounds: int, idle_s: float, rate: float) -> dict[str, object]:
    profiles: list[Profile] = []
    records: list[RequestRecord] = []
    duration_s = 0.0
    for r in range(rounds):
        with baton_serving(["--config", str(CONFIG), "--policy", "round_robin"]) as url:
            profiles.append(measure_profile(url, idle_s))
        args = ["--config", str(CONFIG), "--policy", policy, "--log-level", "warning"]
        with baton_serving(args) as url:
            result = run_bench(BenchConfig(url, WORKLOAD, rate=RateSpec(rate), slo=SLO))
        if result.summary["failed"]:
            raise RuntimeError(f"{policy} round {r}: {result.summary['failed']} requests failed")
        kept, seconds = measured(result.records)
        records += kept
        duration_s += seconds
        print(json.dumps({"policy": policy, "round": r + 1, "of": rounds}), file=sys.stderr)
    profile = mean_profile(profiles)
    simulated = simulate(
        SimConfig(
            workload=WORKLOAD,
            rate=RateSpec(rate),
            num_prefill=1,
            num_decode=1,
            router=RouterSettings.from_config(load_config(CONFIG).router),
            policy=policy,
            profile=profile,
            slo=SLO,
        )
    )
    sim_records, sim_s = measured(simulated.records)
    sim = compute_summary(sim_records, sim_s, SLO)
    live = compute_summary(records, duration_s, SLO)
    error = {k: sim[k] / live[k] - 1 for k in KEYS}
    return {
        "benchmark": "fidelity",
        "policy": policy,
        "rounds": rounds,
        "idle_s": idle_s,
        "live": {k: live[k] for k in KEYS},
        "sim": {k: sim[k] for k in KEYS},
        "rel_error": error,
        "within_bound": all(abs(e) <= BOUND for e in error.values()),
        "profile": {
            "prefill_s": dataclasses.asdict(profile.prefill),
            "decode_s": dataclasses.asdict(profile.decode),
            "transfer_latency_s": profile.transfer.latency_s,
        },
        "load_average_1m": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="round_robin,slo_goodput")
    p.add_argument("--rounds", type=int, default=3, help="profile/bench rounds per policy")
    p.add_argument("--idle-s", type=float, default=0.7, help="quiet before each probe, s")
    p.add_argument("--rate", type=float, default=1.0, help="bench arrivals, requests/s")
    args = p.parse_args()
    freeze_startup_heap()  # this client's full collections would delay what it times
    rows = []
    for policy in args.policies.split(","):
        row = fidelity(policy, args.rounds, args.idle_s, args.rate)
        print(json.dumps(row), flush=True)
        rows.append(row)
    worst = max(abs(e) for row in rows for e in row["rel_error"].values())  # type: ignore[attr-defined]
    summary = {"benchmark": "fidelity", "bound": BOUND, "worst_rel_error": worst}
    print(json.dumps({**summary, "within_bound": worst <= BOUND}))


if __name__ == "__main__":
    main()
