"""``baton simulate``: the bench workload flags plus the cluster shape, policy and profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadgen.flags import add_workload_arguments, slo_from_args, sweep_from_args, workload_from_args
from loadgen.report import format_table, write_run, write_sweep
from loadgen.sim.profile import load_profile
from loadgen.sim.run import SimConfig, simulate
from loadgen.workload import WorkloadError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    g = parser.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers")
    g.add_argument("--decode", type=int, default=1, help="decode workers")
    g.add_argument(
        "--colocated", type=int, default=0, help="N mixed workers (chunked prefill) instead"
    )
    g.add_argument("--mixed", type=int, default=0, help="mixed workers added to the P/D cluster")
    g.add_argument("--policy", default="round_robin", help="router policy (router.policy registry)")
    g.add_argument("--profile", default=None, help="profile JSON (default: shipped tiny-cpu)")
    g.add_argument("--chunk-tokens", type=int, default=512, help="token budget of a mixed step")
    g.add_argument(
        "--prefill-budget", type=int, default=8192, help="token budget of a prefill step"
    )
    g.add_argument("--max-tokens", type=int, default=None, help="max_tokens the router sees")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        workload = workload_from_args(args)
        sweep = sweep_from_args(args)
        slo = slo_from_args(args)
        profile = load_profile(args.profile)
    except (WorkloadError, ValueError, FileNotFoundError) as e:
        print(f"baton simulate: {e}", file=sys.stderr)
        return 2
    summaries = []
    for rate, concurrency in sweep:
        config = SimConfig(
            workload=workload,
            rate=rate,
            concurrency=concurrency,
            num_prefill=args.prefill,
            num_decode=args.decode,
            num_colocated=args.colocated,
            num_mixed=args.mixed,
            policy=args.policy,
            profile=profile,
            slo=slo,
            chunk_tokens=args.chunk_tokens,
            prefill_budget_tokens=args.prefill_budget,
            max_tokens=args.max_tokens,
        )
        try:
            result = simulate(config)
        except (WorkloadError, ValueError) as e:
            print(f"baton simulate: {e}", file=sys.stderr)
            return 2
        summaries.append(result.summary)
        label = rate.label if rate else f"concurrency {concurrency}"
        if args.out is not None:
            out: Path = args.out if len(sweep) == 1 else args.out / _slug(label)
            write_run(out, result.summary, result.records)
        if args.json:
            print(json.dumps(result.summary, sort_keys=True))
        else:
            print(
                format_table(result.summary, title=f"simulate {result.summary['policy']} @ {label}")
            )
    if args.out is not None and len(sweep) > 1:
        write_sweep(args.out, summaries, label=summaries[0]["policy"])
    return 0


def _slug(label: str) -> str:
    return "run-" + "".join(c if c.isalnum() or c in ".-" else "_" for c in label)
