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
    engine.model        the forward pass and the LM head (torch ops run under these frames)
    engine.sample       grammar masks, sampling
    engine.output       appending tokens, finishing requests, stats
    engine.detokenize   (older trees only: the engine's own detokenizer)
    event_loop          asyncio's own bookkeeping (polling included)
    threadpool          executor threads running native code (Ray's, ``to_thread``)

Each Python thread's CPU time (its own clock, read at every sample) is charged to
the stage its stack shows at that sample, so a waiting thread costs nothing and the
stages add up to the CPU the threads used. Threads without Python frames (torch's
OpenMP workers, Ray's core threads) are reported by name (``native:<name>``) from
/proc; a thread is named after its process when it starts, so a Ray worker's torch
OpenMP threads show as ``native:ray::IDLE`` (engine compute), and ``native:worker.io``
and the ``poll`` threads are Ray's transport. The load client's process is reported apart. A thread that spins waiting for
the GIL is charged where it waits; and a stage is known only at sample times, so
shares are estimates (the finer ``--interval-ms``, the better), the totals are not.
``runqueue_wait_s`` is, per thread (by name), the time it was ready to run but waited
for a core (/proc schedstat): on a shared machine the engine thread's wait is what the
other processes took from the engine, which its CPU time does not show.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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

# (path fragment, function names or None for any, stage): the first rule that matches
# any frame of a stack names its stage, so more specific rules come first.
RULES: tuple[tuple[str, frozenset[str] | None, str], ...] = (
    ("/services/gateway/detokenizer.py", None, "gateway.detokenize"),
    ("/services/engine/detokenizer.py", None, "engine.detokenize"),  # before issue 15
    ("/services/engine/sampler.py", None, "engine.sample"),
    ("/services/engine/grammar.py", None, "engine.sample"),
    ("/services/engine/step_inputs.py", None, "engine.inputs"),
    ("/services/engine/attention_metadata.py", None, "engine.inputs"),
    ("/services/engine/model.py", None, "engine.model"),
    ("/services/engine/attention.py", None, "engine.model"),
    ("/services/engine/rope.py", None, "engine.model"),
    ("/services/engine/engine.py", frozenset({"_sample"}), "engine.sample"),
    ("/services/engine/scheduler.py", None, "engine.schedule"),
    ("/services/engine/kv_cache.py", None, "engine.schedule"),
    ("/services/engine/block_hash.py", None, "engine.schedule"),
    ("/services/engine/tokenizer.py", None, "gateway.tokenize"),
    ("/services/engine/", None, "engine.output"),
    ("/services/backends/", None, "engine.output"),
    ("/services/workers/loop.py", None, "worker.loop"),
    ("/services/workers/telemetry.py", None, "worker.loop"),
    ("/services/workers/transfers.py", None, "worker.loop"),
    ("/services/workers/", None, "transport"),
    ("/ray/", None, "transport"),
    # A thread waking an event loop: Ray completing an awaited object, a worker's events
    ("/asyncio/selector_events.py", frozenset({"_write_to_self"}), "transport"),
    ("/concurrent/futures/thread.py", None, "threadpool"),  # Ray's executors, to_thread
    ("/services/gateway/executor.py", None, "gateway.executor"),
    ("/services/gateway/plan_runner.py", None, "gateway.executor"),
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


def classify(frame: FrameType) -> str:
    """The stage a sampled stack belongs to."""
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


def _native_threads_cpu_s() -> dict[int, tuple[str, float]]:
    """Every thread of this process: tid -> (name, CPU seconds so far), from /proc."""
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * tick_s)
    return out


def _threads_run_delay_s() -> dict[int, float]:
    """Every thread of this process: tid -> seconds it waited on a run queue so far."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        except OSError:
            continue  # ended meanwhile, or no schedstat in this kernel
        out[int(tid)] = int(fields[1]) / 1e9
    return out


class StackSampler:
    """Charges each Python thread's CPU time, interval by interval, to the stage its
    stack shows; threads without Python frames (torch's OpenMP workers, Ray's core
    threads) are counted from /proc by thread name."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.cpu_s: Counter[str] = Counter()
        self.unnamed_s: Counter[str] = Counter()  # innermost frames of "other"/"event_loop"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._cpu0_s = 0.0
        self._native0: dict[int, tuple[str, float]] = {}
        self._delay0: dict[int, float] = {}

    def start(self) -> None:
        self._cpu0_s = time.process_time()
        self._native0 = _native_threads_cpu_s()
        self._delay0 = _threads_run_delay_s()
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        names = {t.native_id: t.name for t in threading.enumerate()}
        python_tids = set(names)
        native: Counter[str] = Counter()
        native_now = _native_threads_cpu_s()
        waits: Counter[str] = Counter()
        for tid, delay_s in _threads_run_delay_s().items():
            name = names.get(tid) or f"native:{native_now.get(tid, ('?', 0.0))[0]}"
            waits[name] += delay_s - self._delay0.get(tid, 0.0)
        for tid, (name, cpu_s) in native_now.items():
            if tid not in python_tids:
                native[f"native:{name}"] += cpu_s - self._native0.get(tid, (name, 0.0))[1]
        return {
            "cpu_s": time.process_time() - self._cpu0_s,
            "stages": dict(self.cpu_s),
            "native": {k: v for k, v in native.items() if v > 0},
            "unnamed_top": {k: round(v, 3) for k, v in self.unnamed_s.most_common(6)},
            "runqueue_wait_s": {k: round(v, 3) for k, v in waits.most_common(4) if v >= 0.01},
        }

    def _run(self) -> None:
        me = threading.get_ident()
        clocks: dict[int, int] = {}
        last: dict[int, float] = {}
        while not self._stop.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    clock = clocks.get(ident)
                    if clock is None:
                        clock = clocks[ident] = time.pthread_getcpuclockid(ident)
                    now_s = time.clock_gettime(clock)
                except OSError:
                    continue  # the thread ended
                used_s = now_s - last.get(ident, now_s)
                last[ident] = now_s
                if used_s > 0:
                    stage = classify(frame)
                    self.cpu_s[stage] += used_s
                    if stage in ("other", "event_loop"):  # what to name next
                        code = frame.f_code
                        where = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                        self.unnamed_s[f"{stage}@{where}"] += used_s


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
        "--endpoint", "completions",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--concurrency", str(args.concurrency), "--num-requests", str(n), "--json",
    ]  # fmt: skip
    if tokenizer != "tiny":  # the built-in model's tokenizer is not a folder
        cmd += ["--tokenizer", tokenizer]
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
    from services.cluster.serve import bind_listener
    from services.cluster.specs import worker_specs
    from services.engine.loader import load_tokenizer
    from services.gateway.app import create_app
    from services.gateway.service import GatewayService, GatewaySettings

    config = _config(model, args)
    specs = worker_specs(config, EngineFactory("embedded", config.model, config.engine), None)
    settings = GatewaySettings(config.gateway, config.router, config.model, "none")
    launcher = RayLauncher(num_cpus=0, num_gpus=0) if args.workers == "ray" else launch_in_process
    svc = GatewayService(settings, load_tokenizer(model), specs, launcher)
    sock = bind_listener("127.0.0.1", 0)  # as ``baton serve`` binds (TCP_NODELAY)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started or not svc.controller.is_ready():
        await asyncio.sleep(0.1)
    await _bench(url, tokenizer, args, max(4, args.concurrency // 4))  # warm-up

    client: Any = svc.controller.client(next(iter(svc.controller.workers())))
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
        cpu_s.update(p["stages"])
        cpu_s.update(p["native"])
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
        "by_process": {
            name: {k: round(v, 3) for k, v in Counter({**p["stages"], **p["native"]}).most_common()}
            for name, p in processes.items()
        },
        "unnamed_top": {name: p["unnamed_top"] for name, p in processes.items()},
        "runqueue_wait_s": {name: p["runqueue_wait_s"] for name, p in processes.items()},
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
        from loadgen.scripts import load_script

        save_llama_100m = load_script(_HERE / "checkpoints.py", "bench_checkpoints").save_llama_100m

        folder = Path(tempfile.mkdtemp(prefix="baton-profile-")) / "llama-100m"
        save_llama_100m(folder)
        model = tokenizer = str(folder)
    if args.workers == "ray":
        import ray

        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    print(json.dumps(asyncio.run(_profile(model, tokenizer, args))), flush=True)


if __name__ == "__main__":
    main()
