"""Flags shared by ``baton bench`` and ``baton simulate`` (workload, SLO), and the argparse
types the load tools and benchmarks check their numbers with."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadgen.arrivals import RateSpec, parse_rate, parse_sweep
from loadgen.metrics import GoodputSLO, parse_goodput
from loadgen.scenario import WorkloadConfig
from loadgen.workload import WorkloadError, parse_length

__all__ = [
    "Sweep",
    "above_zero",
    "add_workload_arguments",
    "at_least_zero",
    "counts",
    "server_root",
    "slo_from_args",
    "sweep_from_args",
    "workload_from_args",
]

Sweep = list[tuple[RateSpec | None, int | None]]  # (rate, concurrency) per run


def server_root(text: str) -> str:
    """An argparse type: a server's root URL as the load tools join paths to it. The
    ``base_url`` an OpenAI client takes (``http://host:8000/v1``) is accepted too, and a
    bare ``host:port`` is http: either once asked for ``/v1/v1/models``, or failed with
    httpx's 'missing an http:// or https:// protocol'."""
    url = text.strip().rstrip("/")
    if not url:
        raise argparse.ArgumentTypeError("want a server URL such as http://127.0.0.1:8000")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def above_zero(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0, in ``unit`` (the error names it)."""
    return _finite(unit, zero=False)


def at_least_zero(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number, 0 or more, in ``unit`` (the error names it)."""
    return _finite(unit, zero=True)


def _finite(unit: str, *, zero: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above_floor = value >= 0 if zero else value > 0
        if not (above_floor and value < math.inf):
            want = f"{unit}, 0 or more;" if zero else f"{unit} above 0,"
            raise argparse.ArgumentTypeError(f"want {want} got {text!r}")
        return value

    return parse


def counts(
    what: str, least_distinct: int, why: str, *, single: bool = False
) -> Callable[[str], Any]:
    """An argparse type: comma-separated whole numbers of ``what``, each at least 1, at
    least ``least_distinct`` different (``why``: what needs them); ``single``: one number.
    ``baton profile`` refuses a bad probe list with it before any probe runs: a 0 or a
    negative batch ran every prefill probe, then failed with 'no median for empty data';
    one prompt length fitted a profile of a single point."""

    def parse(text: str) -> Any:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1 or (single and len(values) > 1):
            want = "a whole number of" if single else "whole numbers, comma-separated, of"
            least = "at least 1" if single else "each at least 1"
            raise argparse.ArgumentTypeError(f"want {want} {what}, {least}; got {text!r}")
        if len(set(values)) < least_distinct:
            raise argparse.ArgumentTypeError(
                f"want at least {least_distinct} different {what} ({why}); got {text!r}"
            )
        return values[0] if single else values

    return parse


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument(
        "--input-len",
        default="256",
        help="tokens: N or a distribution, e.g. lognormal:mean=300,sigma=1.0",
    )
    g.add_argument(
        "--output-len", default="128", help="tokens: N or a distribution, e.g. uniform:32-256"
    )
    g.add_argument(
        "--workload",
        type=Path,
        default=None,
        help="Mooncake trace (.jsonl) or ShareGPT file (.json)",
    )
    g.add_argument(
        "--turns", type=int, default=1, help="turns per conversation (shared growing prefix)"
    )
    g.add_argument(
        "--think-time", type=float, default=1.0, help="seconds between turns of a conversation"
    )
    load = g.add_mutually_exclusive_group()
    load.add_argument(
        "--rate", default=None, help="requests/s: N, inf, ramp:R0-R1; a comma list sweeps"
    )
    load.add_argument(
        "--concurrency", default=None, help="closed loop: requests in flight; a comma list sweeps"
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of gaps (1 = Poisson)"
    )
    g.add_argument(
        "--images-per-request",
        default="0",
        help="chat only: images per image request, N or a distribution (generated PNGs)",
    )
    g.add_argument(
        "--image-size", default="336", help="pixels per side of each image: N or a distribution"
    )
    g.add_argument(
        "--image-fraction", type=float, default=1.0, help="share of requests that carry images"
    )
    n = g.add_mutually_exclusive_group()
    n.add_argument("--num-requests", type=int, default=200)
    n.add_argument("--duration", type=float, default=None, help="seconds of arrivals (with --rate)")
    g.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLO targets in ms, e.g. ttft:200 tpot:50 e2el:5000 (vLLM semantics)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for summary.json, requests.jsonl, plots"
    )


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    parse_length(args.input_len)  # fail early with the flag's own message
    parse_length(args.output_len)
    if args.images_per_request.strip() != "0":
        parse_length(args.images_per_request)
        parse_length(args.image_size)
    return WorkloadConfig(
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        duration_s=args.duration,
        workload_file=args.workload,
        turns=args.turns,
        think_time_s=args.think_time,
        burstiness=args.burstiness,
        seed=args.seed,
        images_per_request=args.images_per_request,
        image_size=args.image_size,
        image_fraction=args.image_fraction,
    )


def sweep_from_args(args: argparse.Namespace) -> Sweep:
    if args.concurrency is not None:
        out: Sweep = []
        for item in parse_sweep(args.concurrency):
            if not item.isdigit() or int(item) < 1:
                raise WorkloadError(f"bad --concurrency {item!r}: expected an integer >= 1")
            out.append((None, int(item)))
        return out
    return [(parse_rate(item), None) for item in parse_sweep(args.rate or "inf")]


def slo_from_args(args: argparse.Namespace) -> GoodputSLO | None:
    return parse_goodput(args.goodput)
