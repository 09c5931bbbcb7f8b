"""Goodput of every router policy and of aggregated serving, simulated (``make bench-policies``).

Same mixed-length workload (90% short chat prompts, 10% long documents; output
lengths unknown to the router), same SLO, same seed, same GPU count for
everyone. Each run sends ``duration_s`` SIMULATED seconds of Poisson arrivals
(no request cap), so queues reach their steady state at every rate. For each
GPU count and policy the goodput (the rate at which SLO attainment crosses
90%) is found by bisection on the rate between a low and a high rate per GPU,
interpolated linearly inside the last bracket. Disaggregated policies keep the
best prefill:decode split of the shares tried (every policy tries the same
shares); the aggregated baseline has no split (every GPU is a mixed worker
with chunked prefill). Prints one JSON object per (GPU count, policy)::

    {"gpus", "policy", "goodput", "goodput_per_gpu", "split", "best_baseline", "vs_best_baseline",
     "bound_served_all", "bound_random_shed", "of_bound"}

``best_baseline`` is the best goodput among the other policies and
``aggregated`` in this same run. ``bound_*`` is the fluid bound of
``loadgen.sim.bound`` for the row's split (for ``aggregated``: the GPUs with no
split fixed): the rate served with every request completed, and the goodput
no placement can beat at 90% attainment unless it picks whom to leave
unserved by size; ``of_bound`` is goodput / ``bound_random_shed``. The bound
shows how much room any policy has left. Saves ``attainment_vs_rate_<gpus>.png``.

The default runs 2, 4 and 16 GPUs at 15 s per run (3 bisections; the small
counts show where aggregated serving wins) and 256 GPUs at 2 s per run (2
bisections): one simulated second at 256 GPUs is ~10^4 requests,
and the 2-core budget of ``make bench-policies`` (~10 minutes) allows no more,
so the 256-GPU rows (``"coarse": true``) come from runs too short for queues
to settle and read optimistic for every policy alike (they exceed the fluid
bound). Every disaggregated
policy uses the same split (``--prefill-shares``, default 0.625: 10:6 at 16
GPUs, 160:96 at 256); pass several shares to search per policy. Where
aggregated serving beats a disaggregated policy is printed on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder leads sys.path and benchmarks/router.py would shadow the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from loadgen.arrivals import RateSpec  # noqa: E402
from loadgen.metrics import GoodputSLO  # noqa: E402
from loadgen.plots import plot_attainment_vs_rate  # noqa: E402
from loadgen.scenario import WorkloadConfig, build_requests  # noqa: E402
from loadgen.sim import SimConfig, simulate  # noqa: E402
from loadgen.sim.bound import FluidBound, fluid_bound  # noqa: E402
from loadgen.sim.profile import load_profile  # noqa: E402
from router.policy import available_policies  # noqa: E402

TARGET_ATTAINMENT = 0.9
INPUT_LEN = "mix:0.9*uniform:32-256,0.1*uniform:2000-6000"
OUTPUT_LEN = "uniform:16-256"
SLO = GoodputSLO(ttft_ms=500, tpot_ms=25)
RATE_BRACKET_PER_GPU = (16.0, 64.0)  # bisection starts between these (req/s per GPU)
PREFILL_SHARES = (0.5, 0.625, 0.75)
MAX_TOKENS = 1024  # what clients ask for: the router never sees the true output length
WORKLOAD_NOTE = "max_tokens 1024, true outputs 16-256 unknown to the router; 90% short chat (32-256 prompt tokens) + 10% long documents (2000-6000)"


def goodput_at(points: list[tuple[float, float]], target: float = TARGET_ATTAINMENT) -> float:
    """Highest rate with attainment >= target, interpolated to the first crossing."""
    points = sorted(points)
    best = 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a0 >= target > a1:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
        if a0 >= target:
            best = r0
    if points and points[-1][1] >= target:
        best = points[-1][0]
    return best


@dataclass(frozen=True)
class Grid:
    duration_s: float  # simulated seconds of arrivals per run
    bisect_steps: int  # rate bisections after the bracket's two ends


def bound_for(gpus: int, split: str, profile_name: str) -> FluidBound:
    """The fluid bound for a "P:D:mixed" split (all mixed: no split fixed)."""
    num_prefill, num_decode, num_mixed = (int(x) for x in split.split(":"))
    specs = build_requests(
        WorkloadConfig(input_len=INPUT_LEN, output_len=OUTPUT_LEN, num_requests=20_000, seed=0),
        RateSpec(1.0),
    )
    assert SLO.tpot_ms is not None
    return fluid_bound(
        load_profile(profile_name),
        specs,
        SLO.tpot_ms / 1000,
        num_prefill,
        num_decode,
        gpus=gpus if num_mixed else None,
        attainment=TARGET_ATTAINMENT,
    )


def run_at(
    policy: str, gpus: int, num_prefill: int, rate: float, duration_s: float, profile_name: str
) -> dict[str, Any]:
    config = SimConfig(
        workload=WorkloadConfig(
            input_len=INPUT_LEN,
            output_len=OUTPUT_LEN,
            num_requests=max(200, round(rate * duration_s)),
            seed=0,
        ),
        rate=RateSpec(rate),
        num_prefill=num_prefill,
        num_decode=gpus - num_prefill,
        num_colocated=gpus if policy == "aggregated" else 0,
        policy="round_robin" if policy == "aggregated" else policy,
        profile=load_profile(profile_name),
        slo=SLO,
        max_tokens=MAX_TOKENS,
    )
    return simulate(config).summary


def sweep(
    policy: str, gpus: int, num_prefill: int, grid: Grid, profile_name: str
) -> list[dict[str, Any]]:
    """Runs at the bracket's ends and at each bisection point, sorted by rate."""
    lo, hi = (r * gpus for r in RATE_BRACKET_PER_GPU)
    runs = [run_at(policy, gpus, num_prefill, r, grid.duration_s, profile_name) for r in (lo, hi)]
    attained = {lo: runs[0]["slo_attainment"], hi: runs[1]["slo_attainment"]}
    if attained[lo] >= TARGET_ATTAINMENT > attained[hi]:
        for _ in range(grid.bisect_steps):
            mid = (lo + hi) / 2
            summary = run_at(policy, gpus, num_prefill, mid, grid.duration_s, profile_name)
            runs.append(summary)
            if summary["slo_attainment"] >= TARGET_ATTAINMENT:
                lo = mid
            else:
                hi = mid
    return sorted(runs, key=lambda s: float(s["rate"]))


def best_split(
    policy: str, gpus: int, shares: list[float], grid: Grid, profile_name: str
) -> tuple[float, str, list[dict[str, Any]], float]:
    """(goodput, "P:D:mixed", the winning sweep, the winning prefill share)."""
    if policy == "aggregated":
        runs = sweep(policy, gpus, 0, grid, profile_name)
        points = [(float(s["rate"]), s["slo_attainment"]) for s in runs]
        return goodput_at(points), f"0:0:{gpus}", runs, 0.0
    best: tuple[float, str, list[dict[str, Any]], float] = (-1.0, "", [], 0.0)
    for share in shares:
        num_prefill = min(gpus - 1, max(1, round(share * gpus)))
        runs = sweep(policy, gpus, num_prefill, grid, profile_name)
        g = goodput_at([(float(s["rate"]), s["slo_attainment"]) for s in runs])
        if g > best[0]:
            best = (g, f"{num_prefill}:{gpus - num_prefill}:0", runs, share)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="2,4,16,256", help="comma list of GPU counts")
    parser.add_argument(
        "--duration", type=float, default=15.0, help="simulated seconds of arrivals per run"
    )
    parser.add_argument("--bisect-steps", type=int, default=3)
    parser.add_argument(
        "--large-gpus", type=int, default=64, help="above this many GPUs the coarse search applies"
    )
    parser.add_argument("--large-duration", type=float, default=2.0)
    parser.add_argument("--large-bisect-steps", type=int, default=2)
    parser.add_argument(
        "--prefill-shares",
        default="0.625",
        help="shares of GPUs given to prefill, tried by every disaggregated policy (best kept); "
        f"the default is one split for all, 10:6 at 16 GPUs; {PREFILL_SHARES} searches",
    )
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--policies", default=None, help="comma list (default: all + aggregated)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/policies"))
    args = parser.parse_args()
    policies = args.policies.split(",") if args.policies else [*available_policies(), "aggregated"]
    shares = [float(x) for x in args.prefill_shares.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    # Splits are searched at the first GPU count; larger counts reuse each policy's winner.
    winning_share: dict[str, float] = {}
    for gpus in (int(g) for g in args.gpus.split(",")):
        coarse = gpus > args.large_gpus
        grid = (
            Grid(args.large_duration, args.large_bisect_steps)
            if coarse
            else Grid(args.duration, args.bisect_steps)
        )
        results: dict[str, tuple[float, str]] = {}
        curves: dict[str, list[dict[str, Any]]] = {}
        for policy in policies:
            tried = [winning_share[policy]] if policy in winning_share else shares
            goodput, split, runs, share = best_split(policy, gpus, tried, grid, args.profile)
            winning_share[policy] = share
            results[policy] = (goodput, split)
            print(
                f"# {gpus} GPUs {policy} {split}: {goodput:.1f} req/s", file=sys.stderr, flush=True
            )
            curves[f"{policy} ({split})"] = runs
        for policy, (goodput, split) in results.items():
            others = [g for p, (g, _) in results.items() if p != policy]
            baseline = max(others, default=0.0)
            bound = bound_for(gpus, split, args.profile)
            print(
                json.dumps(
                    {
                        "gpus": gpus,
                        "policy": policy,
                        "goodput": round(goodput, 2),
                        "goodput_per_gpu": round(goodput / gpus, 3),
                        "split": split,  # prefill:decode:mixed
                        "best_baseline": round(baseline, 2),
                        "vs_best_baseline": round(goodput / baseline, 3) if baseline else None,
                        "bound_served_all": round(bound.served_all_rps, 1),
                        "bound_random_shed": round(bound.random_shed_rps, 1),
                        "of_bound": round(goodput / bound.random_shed_rps, 3),
                        "slo_ms": SLO.as_dict(),
                        "workload": WORKLOAD_NOTE,
                        "sim_seconds_per_run": grid.duration_s,
                        "coarse": coarse,
                        "profile": args.profile,
                    }
                ),
                flush=True,
            )
        if "aggregated" in results:
            agg = results["aggregated"][0]
            for policy, (goodput, _) in results.items():
                if policy != "aggregated" and goodput:
                    verdict = "aggregated wins" if agg > goodput else "disaggregated wins"
                    print(
                        f"# {gpus} GPUs: aggregated {agg:.1f} vs {policy} {goodput:.1f} req/s"
                        f" ({agg / goodput:.2f}x): {verdict}",
                        file=sys.stderr,
                    )
        plot_attainment_vs_rate(
            curves,
            args.out / f"attainment_vs_rate_{gpus}.png",
            title=f"{gpus} GPUs, {args.profile}, TTFT<={SLO.ttft_ms:g}ms TPOT<={SLO.tpot_ms:g}ms",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
