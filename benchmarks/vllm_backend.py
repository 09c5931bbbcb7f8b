"""Baton over vLLM against vLLM's own API server: same model, same workload, one run.

    python benchmarks/vllm_backend.py [--eager] [--threads 2] [--num-requests 64]

Builds a ~100M random Llama (hidden 768, 12 layers, 12/4 heads, float32) in a temp
folder, then, one server at a time on this machine:

1. vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``),
2. ``baton serve --backend vllm`` with one colocated worker,
3. ``baton serve --backend vllm`` with 1 prefill + 1 decode worker (vLLM's NixlConnector),

each loaded by ``baton bench`` (completions, closed loop). Prints one JSON object per
line (throughput in output tokens/s, TTFT and TPOT in ms), then a summary line with
Baton's ratios against the vLLM server of the same run. Targets: colocated output
throughput >= 0.9x vLLM's, p50 TTFT within vLLM's + 10 ms.
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

# The repository first: run as a script, this folder leads sys.path and its kvtransfer.py
# would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.scripts import load_script
from loadgen.server_proc import free_port, stop, wait_until_serving

save_llama_100m = load_script(
    Path(__file__).resolve().with_name("checkpoints.py"), "bench_checkpoints"
).save_llama_100m

__all__ = ["free_port", "run_server", "workload_arguments"]


def bench(base_url: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "services.cli", "bench",
        "--base-url", base_url,
        "--endpoint", "completions",
        "--tokenizer", str(folder),
        "--input-len", str(args.input_len),
        "--output-len", str(args.output_len),
        "--concurrency", str(args.concurrency),
        "--num-requests", str(args.num_requests),
        "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


def run_server(
    label: str,
    cmd: list[str],
    port: int,
    folder: Path,
    args: argparse.Namespace,
    log: Path,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start ``cmd``, load it with ``baton bench``, stop it; the row carries the load average
    (1 min) before and after, since on a shared machine it moves every figure."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **(extra_env or {}),
    }
    load_before = os.getloadavg()[0]
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        base_url = f"http://127.0.0.1:{port}"
        try:
            start_s = wait_until_serving(
                base_url, proc, args.start_timeout, path="/v1/models", poll_s=1.0
            )
            cpu_before = tree_cpu_s(proc.pid)
            summary = bench(base_url, folder, args)
            cpu_s = tree_cpu_s(proc.pid) - cpu_before
        finally:
            stop(proc, grace_s=60)
    return {
        "server": label,
        "startup_s": round(start_s, 1),
        **_pick(summary),
        # CPU seconds the server's processes (all descendants) used during the load, per
        # output token: other processes' load inflates it far less than the wall-clock rates.
        "server_cpu_s": round(cpu_s, 1),
        "cpu_ms_per_output_token": round(1e3 * cpu_s / max(summary["total_output_tokens"], 1), 2),
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (Ray's raylet and
    workers, vLLM's engine core)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def workload_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every server-against-vLLM benchmark shares (``run_server`` reads them)."""
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds")
    return p


def _pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "output_tokens_per_s": round(summary["output_throughput"], 2),
        "requests_per_s": round(summary["request_throughput"], 3),
        "ttft_p50_ms": round(summary["median_ttft_ms"], 1),
        "tpot_p50_ms": round(summary["median_tpot_ms"], 1),
        "completed": summary["completed"],
        "failed": summary["failed"],
    }


def main(argv: list[str] | None = None) -> None:
    p = workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--skip-pd", action="store_true", help="leave out 1P+1D")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="baton-vllm-bench-"))
    folder = work / "llama-100m"
    save_llama_100m(folder)
    common = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": args.eager}
    rows: list[dict[str, Any]] = []

    port = free_port()
    vllm_cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--port", str(port), "--dtype", "float32",
        "--max-model-len", "1024", "--seed", "0",
    ] + (["--enforce-eager"] if args.eager else [])  # fmt: skip
    rows.append(run_server("vllm api_server", vllm_cmd, port, folder, args, work / "vllm.log"))
    print(json.dumps(rows[-1]), flush=True)

    config = work / "baton.yaml"
    layouts = [("baton colocated", "colocated", 1, 0)]
    if not args.skip_pd:
        layouts.append(("baton 1P+1D nixl", "disaggregated", 1, 1))
    for label, mode, prefill, decode in layouts:
        config.write_text(
            json.dumps(
                {
                    "engine": {
                        "backend": "vllm",
                        "device": "cpu",
                        "max_model_len": 1024,
                        "kv_cache_bytes": 2**30,
                        "vllm": common,
                    },
                    "router": {"policy": "round_robin"},
                }
            )
        )
        port = free_port()
        cmd = [
            sys.executable, "-m", "services.cli", "serve", "--config", str(config),
            "--model", str(folder), "--dtype", "float32", "--port", str(port),
            "--mode", mode, "--prefill", str(prefill), "--decode", str(decode),
            "--log-level", "warning",
        ]  # fmt: skip
        log = work / f"{label.replace(' ', '_')}.log"
        rows.append(run_server(label, cmd, port, folder, args, log))
        print(json.dumps(rows[-1]), flush=True)

    base, colocated = rows[0], rows[1]
    summary = {
        "summary": "baton over vllm vs vllm api_server (same run)",
        "threads": args.threads,
        "torch_compile": not args.eager,
        "throughput_ratio": round(
            colocated["output_tokens_per_s"] / base["output_tokens_per_s"], 3
        ),
        "throughput_target": 0.9,
        "ttft_p50_delta_ms": round(colocated["ttft_p50_ms"] - base["ttft_p50_ms"], 1),
        "ttft_target_delta_ms": 10,
        "logs": str(work),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
