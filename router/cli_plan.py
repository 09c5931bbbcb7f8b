"""``baton plan``: size prefill and decode pools for a target rate, offline.

Prints one JSON object (``PoolPlan.to_dict`` plus the inputs) on stdout. Where a
target cannot be met by any pool, the plan says so (``meets_targets``, ``shortfalls``),
each shortfall is also a line on stderr, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from router.pool_sizing import WorkloadStats, plan_pools
from router.profile import DEFAULT_PROFILE, load_profile
from router.types import SLO

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, required=True, help="target requests per second")
    parser.add_argument(
        "--profile", default=None, help="cost-model profile JSON (default: built-in)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=float,
        default=1024.0,
        help="mean prompt, tokens (default %(default)g)",
    )
    parser.add_argument(
        "--output-tokens",
        type=float,
        default=256.0,
        help="mean output, tokens (default %(default)g)",
    )
    parser.add_argument(
        "--prefix-hit-tokens",
        type=float,
        default=0.0,
        help="mean cached prefix, tokens (default %(default)g)",
    )
    parser.add_argument(
        "--ttft-ms", type=float, default=2000.0, help="TTFT target, ms (default %(default)g)"
    )
    parser.add_argument(
        "--tpot-ms", type=float, default=200.0, help="TPOT target, ms (default %(default)g)"
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        help="highest prefill load ρ, between 0 and 1 (default %(default)g)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
    except ValueError as e:
        print(f"baton plan: {e}", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile) if args.profile else DEFAULT_PROFILE
    except OSError as e:
        print(f"baton plan: --profile {args.profile}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        print(f"baton plan: --profile {args.profile}: not a profile JSON ({e})", file=sys.stderr)
        return 2
    workload = WorkloadStats(args.prompt_tokens, args.output_tokens, args.prefix_hit_tokens)
    slo = SLO(ttft_s=args.ttft_ms / 1e3, tpot_s=args.tpot_ms / 1e3)
    plan = plan_pools(args.rate, profile, workload, slo, max_utilization=args.utilization)
    print(json.dumps({"rate_per_s": args.rate, "model": profile.model, **plan.to_dict()}))
    for shortfall in plan.shortfalls:
        print(f"baton plan: {shortfall}", file=sys.stderr)
    return 1 if plan.shortfalls else 0


def _check(args: argparse.Namespace) -> None:
    """Each number in its range, naming the flag (a ValueError)."""
    positive = {
        "--rate": args.rate,
        "--prompt-tokens": args.prompt_tokens,
        "--output-tokens": args.output_tokens,
        "--ttft-ms": args.ttft_ms,
        "--tpot-ms": args.tpot_ms,
    }
    for flag, value in positive.items():
        if not 0 < value < math.inf:
            raise ValueError(f"{flag} must be a number above 0, got {value:g}")
    if not 0 <= args.prefix_hit_tokens < args.prompt_tokens:
        raise ValueError(
            f"--prefix-hit-tokens must be at least 0 and below --prompt-tokens "
            f"({args.prompt_tokens:g}), got {args.prefix_hit_tokens:g}"
        )
    if not 0 < args.utilization < 1:
        raise ValueError(f"--utilization must be between 0 and 1, got {args.utilization:g}")
