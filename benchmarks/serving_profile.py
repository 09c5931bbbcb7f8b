"""Where one serving run's CPU time goes: gateway, transport, worker loop, engine step.

    python benchmarks/serving_profile.py [--workers ray|inprocess] [--model llama-100m|tiny]
        [--concurrency 16] [--num-requests 64] [--input-len 128] [--output-len 64] [--threads 2]

Serves the model through the real gateway (uvicorn on a socket) and one colocated
embedded worker (a Ray actor, or in this process), loads it with ``baton bench`` in
a separate process (the workload of ``benchmarks/vs_vllm.py``), and meanwhile
samples the Python stacks of every thread of the gateway process and of the
worker's process (a sampler started inside the actor) every ``--interval-ms``.
Each non-idle sample is charged to the most specific stage found on its stack:

    gateway.http        uvicorn, starlette/fastapi, request parsing, the chat template
    gateway.tokenize    prompt tokenization
    gateway.executor    placement, reservations, the per-request plan
    gateway.sse         SSE / JSON bodies, usage, tool and reasoning shaping
    gateway.detokenize  incremental detokenization and stop strings
    transport           worker streams and channels, Ray's Python side
    worker.loop         the engine loop's own work (commands, deliveries, telemetry)
    engine.schedule     scheduler and block manager
    engine.inputs       flattening the batch, attention metadata
    engine.model        the forward pass (torch ops run under these frames)
    engine.sample       logits, grammar masks, sampling
    engine.output       appending tokens, finishing requests, stats
    event_loop          asyncio's own bookkeeping

A thread blocked in a wait (selector, condition, queue) is idle and not counted. Each
process's shares are scaled to its measured CPU seconds, so the figures add up to
the run's CPU time (the load client's process is reported apart). A thread waiting
for the GIL is charged where it waits: shares are estimates, the totals are not.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

# Run as a script, this folder comes first on sys.path, and benchmarks/kvtransfer.py
# would shadow the kvtransfer package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

_ATTENTION_INPUTS = {"build", "_build_group", "_additive_mask", "_gather_rows", "_to_device"}

# (path fragment, function names or None for any, stage): the first rule that matches
# any frame of a stack names its stage, so more specific rules come first.
RULES: tuple[tuple[str, frozenset[str] | None, str], ...] = (
    ("/services/gateway/detokenizer.py", None, "gateway.detokenize"),
    ("/services/engine/sampler.py", None, "engine.sample"),
    ("/services/engine/grammar.py", None, "engine.sample"),
    ("/services/engine/engine.py", frozenset({"_sample"}), "engine.sample"),
    ("/services/engine/step_inputs.py", None, "engine.inputs"),
    ("/services/engine/attention.py", frozenset(_ATTENTION_INPUTS), "engine.inputs"),
    ("/services/engine/model.py", None, "engine.model"),
    ("/services/engine/attention.py", None, "engine.model"),
    ("/services/engine/rope.py", None, "engine.model"),
    ("/services/engine/scheduler.py", None, "engine.schedule"),
    ("/services/engine/kv_cache.py", None, "engine.schedule"),
    ("/services/engine/block_hash.py", None, "engine.schedule"),
    ("/services/engine/tokenizer.py", None, "gateway.tokenize"),
    ("/services/engine/", None, "engine.output"),
    ("/services/backends/", None, "engine.output"),
    ("/services/workers/loop.py", None, "worker.loop"),
    ("/services/workers/telemetry.py", None, "worker.loop"),
    ("/services/workers/", None, "transport"),
    ("/ray/", None, "transport"),
    ("/services/gateway/executor.py", None, "gateway.executor"),
    ("/services/gateway/state.py", None, "gateway.executor"),
    ("/router/", None, "gateway.executor"),
    ("/services/gateway/respond.py", None, "gateway.sse"),
    ("/services/gateway/openai_format.py", None, "gateway.sse"),
    ("/services/gateway/shaping.py", None, "gateway.sse"),
    ("/services/gateway/parsers.py", None, "gateway.sse"),
    ("/services/gateway/", None, "gateway.http"),
    ("/services/metrics.py", None, "gateway.http"),
    ("/prometheus_client/", None, "gateway.http"),
    ("/uvicorn/", None, "gateway.http"),
    ("/starlette/", None, "gateway.http"),
    ("/fastapi/", None, "gateway.http"),
    ("/h11/", None, "gateway.http"),
    ("/httptools/", None, "gateway.http"),
    ("/anyio/", None, "gateway.http"),
    ("/pydantic/", None, "gateway.http"),
    ("/asyncio/", None, "event_loop"),
)
# The innermost frame of a thread that is waiting, not working.
IDLE = {
    ("selectors.py", "select"),
    ("threading.py", "wait"),
    ("queue.py", "get"),
    ("base_events.py", "_run_once"),  # inside select(); the selector frame may be C
}


def classify(frame: FrameType) -> str | None:
    """The stage a sampled stack belongs to, or None if the thread is idle."""
    code = frame.f_code
    if (os.path.basename(code.co_filename), code.co_name) in IDLE:
        return None
    stack: list[tuple[str, str]] = []
    f: FrameType | None = frame
    while f is not None:
        stack.append((f.f_code.co_filename.replace(os.sep, "/"), f.f_code.co_name))
        f = f.f_back
    for fragment, names, stage in RULES:
        for filename, name in stack:
            if fragment in filename and (names is None or name in names):
                return stage
    return "other"


class StackSampler:
    """Samples every other thread's stack each ``interval_s`` into stage counts."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.counts: Counter[str] = Counter()
        self.num_idle = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._cpu0_s = 0.0

    def start(self) -> None:
        self._cpu0_s = time.process_time()
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {
            "cpu_s": time.process_time() - self._cpu0_s,
            "counts": dict(self.counts),
            "idle": self.num_idle,
        }

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stage = classify(frame)
                if stage is None:
                    self.num_idle += 1
                else:
                    self.counts[stage] += 1


# -- inside the Ray actor (through __ray_call__) --------------------------------------------


def _actor_start(worker: Any, interval_s: float) -> int:
    sampler = StackSampler(interval_s)
    worker._profile_sampler = sampler  # lives with the actor until _actor_stop
    sampler.start()
    return os.getpid()


def _actor_stop(worker: Any) -> dict[str, Any]:
    result: dict[str, Any] = worker._profile_sampler.stop()
    return result


# -- the run ------------------------------------------------------------------------------------


def _config(model: str, args: argparse.Namespace) -> Any:
    from services.config import ClusterConfig

    return ClusterConfig().with_overrides(
        {
            "model.name": model,
            "model.dtype": "float32",
            "engine.device": "cpu",
            "engine.num_threads": args.threads,
            "engine.kv_cache_bytes": 512 * 2**20,
            "engine.max_model_len": 1024,
            "workers.mode": "colocated",
            "workers.prefill": 1,
            "workers.decode": 0,
            "workers.num_cpus": 0,
            "router.policy": "round_robin",
            "gateway.max_inflight_requests": 4096,
        }
    )


async def _bench(url: str, tokenizer: str, args: argparse.Namespace, n: int) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "services.cli", "bench", "--base-url", url,
        "--endpoint", "completions", "--tokenizer", tokenizer,
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--concurrency", str(args.concurrency), "--num-requests", str(n), "--json",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"baton bench failed: {err.decode()[-2000:]}")
    summary: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return summary


async def _profile(model: str, tokenizer: str, args: argparse.Namespace) -> dict[str, Any]:
    import resource

    import uvicorn

    from services.cluster.factories import EngineFactory
    from services.cluster.launchers import RayLauncher, launch_in_process
    from services.cluster.specs import worker_specs
    from services.engine.loader import load_tokenizer
    from services.gateway.app import create_app
    from services.gateway.service import GatewayService, GatewaySettings

    config = _config(model, args)
    specs = worker_specs(config, EngineFactory("embedded", config.model, config.engine), None)
    settings = GatewaySettings(config.gateway, config.router, config.model, "none")
    launcher = RayLauncher(num_cpus=0, num_gpus=0) if args.workers == "ray" else launch_in_process
    svc = GatewayService(settings, load_tokenizer(model), specs, launcher)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started or not svc.controller.is_ready():
        await asyncio.sleep(0.1)
    await _bench(url, tokenizer, args, max(4, args.concurrency // 4))  # warm-up

    client: Any = svc.controller.client(svc.controller.workers()[0])
    actor = getattr(client, "actor", None)
    interval_s = args.interval_ms / 1e3
    sampler = StackSampler(interval_s)
    if actor is not None:
        await actor.__ray_call__.remote(_actor_start, interval_s)
    messages0 = getattr(client, "num_messages", 0)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    sampler.start()
    started_s = time.monotonic()
    summary = await _bench(url, tokenizer, args, args.num_requests)
    wall_s = time.monotonic() - started_s
    processes = {"gateway" if actor is not None else "gateway+worker": sampler.stop()}
    if actor is not None:
        processes["worker"] = await actor.__ray_call__.remote(_actor_stop)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_cpu_s = (children.ru_utime + children.ru_stime) - (children0.ru_utime + children0.ru_stime)
    messages = getattr(client, "num_messages", 0) - messages0
    server.should_exit = True
    await serving
    return _report(processes, summary, wall_s, load_cpu_s, messages, args)


def _report(
    processes: dict[str, dict[str, Any]],
    summary: dict[str, Any],
    wall_s: float,
    load_cpu_s: float,
    num_messages: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    cpu_s: Counter[str] = Counter()
    for p in processes.values():
        total = sum(p["counts"].values())
        for stage, n in p["counts"].items():
            cpu_s[stage] += p["cpu_s"] * n / total if total else 0.0
    served_cpu_s = sum(p["cpu_s"] for p in processes.values())
    num_tokens = round(summary["output_throughput"] * summary["duration"])
    return {
        "bench": "serving_profile",
        "workers": args.workers,
        "model": args.model,
        "threads": args.threads,
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "output_tokens_per_s": round(summary["output_throughput"], 2),
        "tpot_p50_ms": round(summary["median_tpot_ms"], 1),
        "ttft_p50_ms": round(summary["median_ttft_ms"], 1),
        "wall_s": round(wall_s, 2),
        "process_cpu_s": {k: round(p["cpu_s"], 2) for k, p in processes.items()},
        "load_client_cpu_s": round(load_cpu_s, 2),
        "cpu_s": {k: round(v, 3) for k, v in cpu_s.most_common()},
        "share": {k: round(v / served_cpu_s, 3) for k, v in cpu_s.most_common()},
        "cpu_ms_per_output_token": round(1e3 * served_cpu_s / max(1, num_tokens), 3),
        "transport_messages": num_messages if args.workers == "ray" else None,
        "output_tokens": num_tokens,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", choices=["ray", "inprocess"], default="ray")
    p.add_argument("--model", choices=["llama-100m", "tiny"], default="llama-100m")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=5.0)
    args = p.parse_args(argv)

    if args.model == "tiny":
        model = tokenizer = "tiny"
    else:
        sys.path.insert(0, str(_HERE))
        from engine import save_llama_100m  # benchmarks/engine.py

        folder = Path(tempfile.mkdtemp(prefix="baton-profile-")) / "llama-100m"
        save_llama_100m(folder)
        model = tokenizer = str(folder)
    if args.workers == "ray":
        import ray

        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    print(json.dumps(asyncio.run(_profile(model, tokenizer, args))), flush=True)


if __name__ == "__main__":
    main()
