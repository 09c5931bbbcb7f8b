"""Live TPOT and TTFT of ``baton serve`` from two source trees, alternated in one run.

    python benchmarks/serve_ab.py --tree /path/to/old/checkout [--tree ...] [--rounds 2]

For chasing a serving regression by A/B (``git worktree add /tmp/old <commit>``, then
this): each round serves every tree in turn with ``deploy/configs/local.yaml`` (the
tiny model, 1 prefill + 1 decode worker over NIXL, as
``benchmarks/fidelity.py``), loads it with that test's workload through
``baton bench`` of *this* tree (open loop, 1 request/s, 40 requests, 32-512 prompt and
8-64 output tokens, seed 1) and prints one JSON object per run: the tree, its commit,
p50/p90 TPOT and TTFT, and the machine's 1-minute load average before and after.

On a shared 2-core machine these figures follow the load of everything else running:
compare trees only within one round, and only rounds whose load averages are low.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadgen.server_proc import free_port, stop, wait_until_serving

_ROOT = Path(__file__).resolve().parent.parent
_KEYS = ("median_tpot_ms", "p90_tpot_ms", "median_ttft_ms", "p90_ttft_ms", "failed")


def _bench(url: str, out_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "--base-url", url,
        "--endpoint", "completions", "--input-len", "uniform:32-512",
        "--output-len", "uniform:8-64", "--rate", "1", "--num-requests", "40",
        "--seed", "1", "--json", "--out", str(out_dir),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    done = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    return {key: summary[key] for key in _KEYS}


def serve_and_measure(tree: Path, start_timeout_s: float) -> dict[str, Any]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [
        sys.executable, "-m", "services.cli", "serve", "--config", "deploy/configs/local.yaml",
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, start_timeout_s, path="/v1/models", poll_s=1.0)
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as out_dir:
            figures = _bench(url, Path(out_dir))
        load_after = os.getloadavg()[0]
    finally:
        stop(proc, grace_s=60)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    return {
        "tree": str(tree),
        "commit": commit,
        **{k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()},
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(load_after, 2),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", default=[], help="a checkout to serve (repeat)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    trees = [_ROOT, *(Path(t).resolve() for t in args.tree)]
    for round_index in range(args.rounds):
        for tree in trees:
            row = serve_and_measure(tree, args.start_timeout)
            print(json.dumps({"round": round_index, **row}), flush=True)


if __name__ == "__main__":
    main()
