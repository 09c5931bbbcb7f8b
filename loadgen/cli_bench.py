"""``baton bench``: load-test a running OpenAI-compatible server, or compare two runs.

Each point of a sweep (``--rate 1,2,4`` or ``--concurrency 1,8``) is one run
folder under ``--out``; the sweep adds ``sweep.json`` and an
attainment/goodput-vs-rate plot. ``--compare DIR_A DIR_B`` prints two
summaries side by side and sends nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import cast

import httpx

from loadgen.client import BenchConfig, ModelNotServed, client_api_key, run_bench
from loadgen.console import ProgressBar
from loadgen.flags import (
    above_zero,
    add_workload_arguments,
    server_root,
    slo_from_args,
    sweep_from_args,
    workload_from_args,
)
from loadgen.report import compare_table, format_table, load_summary, write_run, write_sweep
from loadgen.scenario import Tokenizer
from loadgen.workload import WorkloadError
from services.heap import freeze_startup_heap

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        type=server_root,
        default="http://127.0.0.1:8000",
        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)",
    )
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    parser.add_argument(
        "--timeout", type=above_zero("seconds"), default=600.0, help="seconds per request (above 0)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer folder of the target model: prompt lengths in its tokens "
        "(default: approximate, one character per token)",
    )
    parser.add_argument(
        "--api-key-file",
        help="send the bearer key in this file (default: $BATON_API_KEY, then $OPENAI_API_KEY)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"), help="compare two run folders"
    )
    add_workload_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        return _compare(args.compare[0], args.compare[1])
    try:
        workload = workload_from_args(args)
        sweep = sweep_from_args(args)
        slo = slo_from_args(args)
        key = client_api_key(args.api_key_file, os.environ)
    except (WorkloadError, ValueError, OSError) as e:
        print(f"baton bench: {e}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer_folder(args.tokenizer) if args.tokenizer else None
    # The environment gives the key (above) and CI: CI runs and pipes get no progress bar.
    interactive = sys.stdout.isatty() and not os.environ.get("CI")
    freeze_startup_heap()  # a full collection mid-run would delay every answer it times
    summaries = []
    for rate, concurrency in sweep:
        label = rate.label if rate else f"concurrency {concurrency}"
        config = BenchConfig(
            base_url=args.base_url,
            workload=workload,
            rate=rate,
            concurrency=concurrency,
            model=args.model,
            endpoint=args.endpoint,
            slo=slo,
            timeout_s=args.timeout,
            tokenizer=tokenizer,
            api_key=key,
        )
        try:
            result = run_bench(config, progress=ProgressBar(label) if interactive else None)
        except (WorkloadError, ModelNotServed) as e:  # found before the first request
            print(f"baton bench: {e}", file=sys.stderr)
            return 2
        except (httpx.HTTPError, OSError, RuntimeError) as e:  # unreachable, no model listed
            # A timeout's message is empty: its name says what happened.
            print(f"baton bench: {args.base_url}: {str(e) or type(e).__name__}", file=sys.stderr)
            return 1
        summaries.append(result.summary)
        if args.out is not None:
            out: Path = args.out if len(sweep) == 1 else args.out / _slug(label)
            write_run(out, result.summary, result.records)
        if args.json:
            print(json.dumps(result.summary, sort_keys=True))
        else:
            print(format_table(result.summary, title=f"bench @ {label}"))
    if args.out is not None and len(sweep) > 1:
        write_sweep(args.out, summaries, label="bench")
    return 0


def load_tokenizer_folder(path: str) -> Tokenizer:
    """A local Hugging Face tokenizer folder, never downloaded (``baton bench --tokenizer``)."""
    from transformers import AutoTokenizer  # heavy: only when asked for

    return cast(Tokenizer, AutoTokenizer.from_pretrained(path, local_files_only=True))


def _compare(a: Path, b: Path) -> int:
    """Two runs side by side; two sweeps (``sweep.json`` and a ``run-<rate>`` folder a
    rate) run by run, at each rate both ran."""
    runs_a, runs_b = _runs(a), _runs(b)
    if (None in runs_a) != (None in runs_b):
        print(
            f"baton bench --compare: {a} and {b} are not both runs or both sweeps; compare "
            "a sweep's rate with a run as SWEEP/run-<rate>",
            file=sys.stderr,
        )
        return 2
    common = [name for name in runs_a if name in runs_b]
    if not common:
        print(f"baton bench --compare: {a} and {b} ran no rate in common", file=sys.stderr)
        return 2
    names = (a.name or str(a), b.name or str(b))
    tables = []
    for name in common:
        try:
            sa, sb = load_summary(runs_a[name]), load_summary(runs_b[name])
        except (FileNotFoundError, json.JSONDecodeError) as e:
            print(f"baton bench --compare: {e}", file=sys.stderr)
            return 2
        table = compare_table(sa, sb, names=names)
        tables.append(table if name is None else f"{'=' * 12} {name} {'=' * 12}\n{table}")
    print("\n\n".join(tables))
    return 0


def _runs(path: Path) -> dict[str | None, Path]:
    """A sweep folder's runs by folder name (``run-4``), else ``{None: path}``."""
    if not (path / "summary.json").exists() and (path / "sweep.json").exists():
        runs = sorted(path.glob("run-*"), key=lambda p: (len(p.name), p.name))
        return {p.name: p for p in runs if (p / "summary.json").exists()}
    return {None: path}


def _slug(label: str) -> str:
    return "run-" + "".join(c if c.isalnum() or c in ".-" else "_" for c in label)
