"""``baton simulate``: the bench workload flags plus the cluster shape, policy and profile.

``--config`` reads a ``baton serve`` config file: the router is built from its
``router`` section exactly as the gateway builds it (``RouterSettings.from_config``),
and its ``workers`` counts are the cluster shape unless flags say otherwise. The
router's cost model is seeded from ``router.profile`` (a ``baton profile`` output), else
``--router-profile``, else the simulated ``--profile`` itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loadgen.flags import add_workload_arguments, slo_from_args, sweep_from_args, workload_from_args
from loadgen.report import format_table, write_run, write_sweep
from loadgen.sim.profile import Profile, load_profile
from loadgen.sim.run import SimConfig, simulate
from loadgen.workload import WorkloadError
from router.front_door import RouterSettings
from services.config import ClusterConfig, RouterConfig, load_config

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    g = parser.add_argument_group("cluster")
    g.add_argument("--config", default=None, help="a baton serve config file (router, workers)")
    g.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1)")
    g.add_argument("--decode", type=int, default=None, help="decode workers (default 1)")
    g.add_argument(
        "--colocated", type=int, default=0, help="N mixed workers (chunked prefill) instead"
    )
    g.add_argument("--mixed", type=int, default=0, help="mixed workers added to the P/D cluster")
    g.add_argument(
        "--encode", type=int, default=None, help="encode workers added (default: the config's, 0)"
    )
    g.add_argument(
        "--image-tokens",
        type=int,
        default=576,
        help="image tokens per image (LLaVA-1.5: 576), or per tile with --image-tile-px",
    )
    g.add_argument(
        "--image-tile-px",
        type=int,
        default=None,
        help="tile images by their size, InternVL2-style (448: tiles of 448 px and a thumbnail)",
    )
    g.add_argument("--max-image-tiles", type=int, default=12, help="with --image-tile-px")
    g.add_argument(
        "--policy", default=None, help="router policy (default: the config's, slo_goodput)"
    )
    g.add_argument("--profile", default=None, help="simulated hardware (default: tiny-cpu)")
    g.add_argument(
        "--router-profile", default=None, help="the router's cost-model seed (baton profile JSON)"
    )
    g.add_argument(
        "--no-rebalance", action="store_true", help="no P/D role flips (served: rebalancing on)"
    )
    g.add_argument(
        "--flip-latency", type=float, default=0.5, help="seconds from drained to flipped"
    )
    g.add_argument("--chunk-tokens", type=int, default=512, help="token budget of a mixed step")
    g.add_argument(
        "--prefill-budget", type=int, default=8192, help="token budget of a prefill step"
    )
    g.add_argument(
        "--long-prefill-tokens",
        type=int,
        default=None,
        help="the engines' long_prefill_token_threshold (default: the config's, 0: none)",
    )
    g.add_argument("--max-tokens", type=int, default=None, help="max_tokens the router sees")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        workload = workload_from_args(args)
        sweep = sweep_from_args(args)
        slo = slo_from_args(args)
        profile = load_profile(args.profile)
        served = load_config(args.config) if args.config else ClusterConfig()
        router = _router_settings(served.router, args.router_profile, profile)
    except (WorkloadError, ValueError, FileNotFoundError) as e:
        print(f"baton simulate: {e}", file=sys.stderr)
        return 2
    summaries = []
    for rate, concurrency in sweep:
        label = rate.label if rate else f"concurrency {concurrency}"
        config = SimConfig(
            workload=workload,
            rate=rate,
            concurrency=concurrency,
            num_prefill=_count(args.prefill, served.workers.prefill, args.config),
            num_decode=_count(args.decode, served.workers.decode, args.config),
            num_colocated=args.colocated,
            num_mixed=args.mixed,
            num_encode=args.encode if args.encode is not None else served.workers.encode,
            image_tokens_per_image=args.image_tokens,
            image_tile_px=args.image_tile_px,
            max_image_tiles=args.max_image_tiles,
            router=router,
            policy=args.policy,
            profile=profile,
            slo=slo,
            chunk_tokens=args.chunk_tokens,
            prefill_budget_tokens=args.prefill_budget,
            long_prefill_tokens=(
                args.long_prefill_tokens
                if args.long_prefill_tokens is not None
                else served.engine.long_prefill_token_threshold
            ),
            max_tokens=args.max_tokens,
            rebalance=not args.no_rebalance,
            flip_latency_s=args.flip_latency,
            progress=Progress(label),
        )
        try:
            result = simulate(config)
        except (WorkloadError, ValueError) as e:
            print(f"baton simulate: {e}", file=sys.stderr)
            return 2
        summaries.append(result.summary)
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


class Progress:
    """A line on stderr at most every ``every_s`` seconds of wall time while a run goes:
    requests finished of all, and how far into the simulated run."""

    def __init__(self, label: str, every_s: float = 2.0) -> None:
        self.label = label
        self.every_s = every_s
        self._last_s = time.monotonic()

    def __call__(self, done: int, total: int, simulated_s: float) -> None:
        now = time.monotonic()
        if now - self._last_s < self.every_s:
            return
        self._last_s = now
        print(
            f"baton simulate @ {self.label}: {done}/{total} requests finished, "
            f"{simulated_s:.1f} simulated s",
            file=sys.stderr,
            flush=True,
        )


def _slug(label: str) -> str:
    return "run-" + "".join(c if c.isalnum() or c in ".-" else "_" for c in label)


def _router_settings(
    config: RouterConfig, router_profile: str | None, simulated: Profile
) -> RouterSettings:
    """The router ``baton serve`` builds from ``config``; seeded as the module says."""
    if config.profile is not None:
        return RouterSettings.from_config(config)
    seed = load_profile(router_profile) if router_profile else simulated
    return RouterSettings.from_config(config, profile=seed)


def _count(flag: int | None, configured: int, config_path: str | None) -> int:
    if flag is not None:
        return flag
    return configured if config_path else 1
