"""Simulator speed: 100,000 requests over 512 workers (target: under 60 s wall).

The issue's command, ``baton simulate --prefill 256 --decode 256 --policy slo_goodput
--num-requests 100000 --rate 2000`` with lognormal inputs (mean 600) and outputs
(mean 200), through the same ``router.Router`` ``baton serve`` builds.

Prints one JSON line per run with the wall time, events and router decisions
per second. The same-run baseline is the identical cluster and workload with
the trivial ``round_robin`` policy, so the router's share of the time shows
as the difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder leads sys.path and benchmarks/router.py would shadow the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402

from loadgen.arrivals import RateSpec  # noqa: E402
from loadgen.metrics import GoodputSLO  # noqa: E402
from loadgen.scenario import WorkloadConfig  # noqa: E402
from loadgen.sim import SimConfig, simulate  # noqa: E402
from router.policy import available_policies  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=512)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument(
        "--policies", default="slo_goodput", help="comma list beside round_robin (all: every one)"
    )
    args = parser.parse_args()
    policies = available_policies() if args.policies == "all" else args.policies.split(",")
    policies = ["round_robin"] + [p for p in policies if p != "round_robin"]
    workload = WorkloadConfig(
        input_len="lognormal:mean=600,sigma=1.0",
        output_len="lognormal:mean=200,sigma=1.0",
        num_requests=args.requests,
        seed=0,
    )
    for policy in policies:
        half = args.workers // 2
        config = SimConfig(
            workload=workload,
            rate=RateSpec(args.rate),
            num_prefill=half,
            num_decode=args.workers - half,
            policy=policy,
            slo=GoodputSLO(ttft_ms=400, tpot_ms=40),
        )
        s = simulate(config).summary
        print(
            json.dumps(
                {
                    "bench": "sim_scale",
                    "policy": policy,
                    "requests": args.requests,
                    "workers": args.workers,
                    "wall_s": round(s["sim_wall_s"], 2),
                    "target_wall_s": 60.0,
                    "events": s["num_events"],
                    "cpu_s": round(s["sim_cpu_s"], 2),
                    "decisions_per_s": round(s["num_decisions"] / s["sim_wall_s"], 1),
                    "completed": s["completed"],
                    "slo_attainment": s["slo_attainment"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
