"""Baton's embedded engine served against vLLM's API server: same model, same CPU, one run.

    python benchmarks/vs_vllm.py [--threads 2] [--num-requests 64] [--eager]   # make bench-vs-vllm

Builds the ~76M random Llama of ``benchmarks/engine.py`` (hidden 768, 12 layers, 12/4
heads, float32) in a temp folder, then, one server at a time on this machine:

1. vLLM's OpenAI API server (``python -m vllm.entrypoints.openai.api_server``),
2. ``baton serve`` with one colocated embedded worker (a Ray actor),

each with the same number of CPU threads (see ``--vllm-bind``) and loaded by ``baton bench`` (completions,
closed loop, concurrency 16, 64 requests, 128 prompt / 64 output tokens). Prints one
JSON object per line (output tokens/s, TTFT and TPOT in ms), then a summary with
Baton's ratios against the vLLM server of the same run, and each server's CPU seconds
(all its processes) per output token during the load. Targets: output throughput
>= 1.0x vLLM's (moonshot 1.3x) and median TPOT <= vLLM's. On a shared machine only
the ratios mean anything.

Threads: vLLM's CPU worker binds its OpenMP threads itself and ignores ``OMP_NUM_THREADS``.
Its default (``VLLM_CPU_OMP_THREADS_BIND=auto``) keeps one core per rank for its scheduler
and front end, so on this 2-core machine it computed with **one** thread on core 0 (its log:
``core ids=[0]``, ``reserved_cpus=[1]``) while Baton's worker ran ``--threads`` threads.
``--vllm-bind same`` (the default) binds vLLM to cores ``0..threads-1``, the same count as
Baton; ``--vllm-bind auto`` keeps vLLM's own choice. Each row records the cores vLLM bound
(read from its log) and the 1-minute load average before and after it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# benchmarks/vllm_backend.py, which also puts the repository ahead of this folder.
from vllm_backend import free_port, run_server, workload_arguments

from loadgen.scripts import load_script

save_llama_100m = load_script(
    Path(__file__).resolve().with_name("checkpoints.py"), "bench_checkpoints"
).save_llama_100m


def baton_config(threads: int) -> dict[str, Any]:
    return {
        "engine": {
            "backend": "embedded",
            "device": "cpu",
            "num_threads": threads,
            "max_model_len": 1024,
            "kv_cache_bytes": 2**30,
        },
        "router": {"policy": "round_robin"},
    }


def main(argv: list[str] | None = None) -> None:
    p = workload_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--skip-vllm", action="store_true", help="only Baton (no ratios)")
    p.add_argument(
        "--vllm-bind",
        choices=["same", "auto"],
        default="same",
        help="same: vLLM computes on --threads cores, as Baton; auto: vLLM's own binding",
    )
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="baton-vs-vllm-"))
    folder = work / "llama-76m"
    save_llama_100m(folder)
    rows: list[dict[str, Any]] = []

    if not args.skip_vllm:
        port = free_port()
        vllm_cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--seed", "0",
        ] + (["--enforce-eager"] if args.eager else [])  # fmt: skip
        bind = (
            {} if args.vllm_bind == "auto" else {"VLLM_CPU_OMP_THREADS_BIND": _cores(args.threads)}
        )
        log = work / "vllm.log"
        rows.append(run_server("vllm api_server", vllm_cmd, port, folder, args, log, bind))
        rows[-1]["omp_cores"] = _bound_cores(log)
        print(json.dumps(rows[-1]), flush=True)

    config = work / "baton.yaml"
    config.write_text(json.dumps(baton_config(args.threads)))
    port = free_port()
    cmd = [
        sys.executable, "-m", "services.cli", "serve", "--config", str(config),
        "--model", str(folder), "--dtype", "float32", "--port", str(port),
        "--mode", "colocated", "--prefill", "1", "--decode", "0", "--log-level", "warning",
    ]  # fmt: skip
    for attempt in range(2):  # on a crowded machine Ray's node may time out starting
        try:
            log = work / f"baton{attempt}.log"
            rows.append(run_server("baton embedded", cmd, port, folder, args, log))
            break
        except RuntimeError as e:
            print(json.dumps({"server": "baton embedded", "start_failed": str(e)}), flush=True)
    else:
        raise SystemExit("baton serve did not start twice; see " + str(work))
    print(json.dumps(rows[-1]), flush=True)
    if args.skip_vllm:
        return

    base, baton = rows
    summary = {
        "summary": "baton embedded vs vllm api_server (same run)",
        "threads": args.threads,
        "vllm_bind": args.vllm_bind,
        "vllm_torch_compile": not args.eager,
        "throughput_ratio": round(baton["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
        "throughput_target": 1.0,
        "tpot_p50_ratio": round(baton["tpot_p50_ms"] / base["tpot_p50_ms"], 3),
        "tpot_target": "<= 1.0",
        "ttft_p50_ratio": round(baton["ttft_p50_ms"] / base["ttft_p50_ms"], 3),
        # Server CPU per output token, Baton over vLLM (< 1: Baton spends less). Less
        # sensitive to other processes' load than the wall-clock ratios above.
        "cpu_per_token_ratio": round(
            baton["cpu_ms_per_output_token"] / base["cpu_ms_per_output_token"], 3
        ),
        "logs": str(work),
    }
    print(json.dumps(summary), flush=True)


def _cores(threads: int) -> str:
    return "0" if threads == 1 else f"0-{threads - 1}"


def _bound_cores(log: Path) -> str | None:
    """The core list vLLM's worker bound its OpenMP threads to, from its start-up log."""
    found = re.search(r"core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
    return found.group(1) if found else None


if __name__ == "__main__":
    main()
