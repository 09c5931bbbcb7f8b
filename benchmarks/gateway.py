"""What the gateway, the router and the Ray hop add to TTFT, and how many streams it sustains.

Baseline (same run, same model, same machine): the tiny engine called in-process,
``add_request`` then ``step`` until the first token, each request after ``GAP_S`` of
idle, about what the served engine sees between the sequential requests (the client's
round trip): a step after 2 ms of idle took 0.48-0.54 ms here against 0.31 ms back to
back (the core wakes slower, its caches colder), and inside the served worker the step
took 0.51 ms (in-process) to 0.64 ms (Ray), instrumented. ``added_*`` is served minus
that; ``added_over_hot_*`` is served minus the back-to-back engine, which also counts
the engine's own wake-up as added by the gateway. Served: a short prompt
streamed through the real HTTP gateway (uvicorn on a socket) to one colocated
worker, in-process and as a Ray actor; the load runs in a separate client
process. Prints JSON lines:

    {"bench": "gateway_ttft", "workers": "ray", "p50_ms", "p99_ms",
     "baseline_p50_ms", "baseline_p99_ms", "added_p50_ms", "added_p99_ms",
     "baseline_hot_p50_ms", "added_over_hot_p50_ms", ...}
    {"bench": "gateway_throughput", "workers": "ray", "streams_per_s",
     "baseline_streams_per_s", ...}

``--scale``: requests per second sustained by one ``baton gateway`` process and by two,
over the same workers (a control plane of two colocated workers in a local Ray), in one
run; the client spreads its load over the gateways:

    {"bench": "gateway_scale", "one_gateway_requests_per_s", "two_gateways_requests_per_s",
     "ratio", ...}

Usage: ``python benchmarks/gateway.py [--requests 200] [--concurrency 32] [--duration-s 8]
[--scale]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, and benchmarks/kvtransfer.py
# would shadow the kvtransfer package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PROMPT = "Hello!"
MODEL = "tiny"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _config(workers: str) -> Any:
    from services.config import ClusterConfig

    return ClusterConfig().with_overrides(
        {
            "model.name": MODEL,
            "engine.device": "cpu",
            "engine.num_threads": 1,
            "engine.kv_cache_bytes": 16 * 2**20,
            "workers.mode": "colocated",
            "workers.prefill": 1,
            "workers.decode": 0,
            "workers.num_cpus": 0,
            "router.policy": "round_robin",
            "gateway.max_inflight_requests": 4096,
        }
    )


# -- baseline: the engine in-process -----------------------------------------------------


GAP_S = 0.002  # idle before each baseline request, as between the served ones


def baseline(num_requests: int, concurrency: int, duration_s: float) -> dict[str, float]:
    from services.backends import make_engine
    from services.engine.loader import load_tokenizer
    from services.engine.messages import EngineRequest, SamplingParams

    config = _config("inprocess")
    engine = make_engine("embedded", config.model, config.engine)
    prompt = tuple(load_tokenizer(MODEL).encode(PROMPT))
    first = SamplingParams(max_tokens=1, temperature=0.0)
    ttfts: dict[float, list[float]] = {0.0: [], GAP_S: []}
    for i in range(num_requests + 10):
        for gap_s, times in ttfts.items():  # alternated: the same phases of the machine
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            engine.add_request(EngineRequest(f"b{i}-{gap_s}", prompt, first))
            while not engine.step():
                pass
            if i >= 10:  # warm-up
                times.append(time.perf_counter() - t0)
            while engine.has_unfinished():
                engine.step()
    # Throughput: keep `concurrency` requests of 8 tokens in flight, count finishes.
    eight = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    next_id, done = 0, 0
    for _ in range(concurrency):
        engine.add_request(EngineRequest(f"t{next_id}", prompt, eight))
        next_id += 1
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        for out in engine.step():
            if out.finished:
                done += 1
                engine.add_request(EngineRequest(f"t{next_id}", prompt, eight))
                next_id += 1
    return {
        "p50_ms": 1e3 * statistics.median(ttfts[GAP_S]),
        "p99_ms": 1e3 * _percentile(ttfts[GAP_S], 0.99),
        "hot_p50_ms": 1e3 * statistics.median(ttfts[0.0]),
        "hot_p99_ms": 1e3 * _percentile(ttfts[0.0], 0.99),
        "streams_per_s": done / duration_s,
    }


# -- the load client (a separate process) -------------------------------------------------


def _client(url: str, num_requests: int, concurrency: int, duration_s: float, out: Any) -> None:
    import httpx

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    # Without TCP_NODELAY the body, sent after the headers, waits for a delayed ACK (~40 ms).
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    ttfts = []
    transport = httpx.HTTPTransport(socket_options=nodelay)
    with httpx.Client(base_url=url, timeout=60, transport=transport) as client:
        for i in range(num_requests + 10):
            t0 = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                first = True
                for line in r.iter_lines():  # read to the end so the connection is reused
                    if first and line.startswith("data: {"):
                        first = False
                        if i >= 10:
                            ttfts.append(time.perf_counter() - t0)

    async def load() -> int:
        stream8 = {**body, "max_tokens": 8, "ignore_eos": True}
        done = 0
        end = time.perf_counter() + duration_s
        limits = httpx.Limits(max_connections=concurrency)
        transport = httpx.AsyncHTTPTransport(socket_options=nodelay, limits=limits)
        async with httpx.AsyncClient(base_url=url, timeout=60, transport=transport) as client:

            async def user() -> None:
                nonlocal done
                while time.perf_counter() < end:
                    async with client.stream("POST", "/v1/completions", json=stream8) as r:
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                done += 1

            await asyncio.gather(*(user() for _ in range(concurrency)))
        return done

    cpu0_s = time.process_time()
    finished = asyncio.run(load())
    # If the client's own CPU time nears the duration, the client is the limit, not us.
    client_cpu_fraction = (time.process_time() - cpu0_s) / duration_s
    out.put(
        {
            "ttfts": ttfts,
            "streams_per_s": finished / duration_s,
            "client_cpu_fraction": client_cpu_fraction,
        }
    )


def _scale_client(urls: list[str], concurrency: int, duration_s: float, out: Any) -> None:
    """Closed loop: ``concurrency`` users, each on one gateway (round robin), for ``duration_s``."""
    import httpx

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

    async def load() -> int:
        done = 0
        end = time.perf_counter() + duration_s
        limits = httpx.Limits(max_connections=concurrency)
        transport = httpx.AsyncHTTPTransport(socket_options=nodelay, limits=limits)
        async with httpx.AsyncClient(timeout=60, transport=transport) as client:

            async def user(url: str) -> None:
                nonlocal done
                while time.perf_counter() < end:
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line == "data: [DONE]":
                                done += 1

            await asyncio.gather(*(user(urls[i % len(urls)]) for i in range(concurrency)))
        return done

    cpu0_s = time.process_time()
    finished = asyncio.run(load())
    out.put(
        {
            "requests_per_s": finished / duration_s,
            "client_cpu_fraction": (time.process_time() - cpu0_s) / duration_s,
        }
    )


def _measure_scale(urls: list[str], args: argparse.Namespace) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_scale_client, args=(urls, args.concurrency, args.duration_s, out))
    proc.start()
    result: dict[str, float] = out.get(timeout=args.duration_s + 120)
    proc.join()
    return result


def scale(args: argparse.Namespace) -> None:
    """One gateway process, then two, over the same control plane's workers."""
    import subprocess

    import ray

    from loadgen.server_proc import ROOT, child_env, free_port, wait_until_serving
    from services.cluster.control_plane import start_control_plane

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    config = _config("ray").with_overrides({"workers.prefill": 2})
    plane = start_control_plane(config)
    ray.get(plane.start.remote(), timeout=300)
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            command = [sys.executable, "-m", "services.cli", "gateway"]
            command += ["--ray-address", address, "--port", str(port), "--log-level", "warning"]
            procs.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=child_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_until_serving(url, proc, timeout_s=300)
        _measure_scale(urls[:1], argparse.Namespace(**{**vars(args), "duration_s": 2.0}))  # warm
        one = _measure_scale(urls[:1], args)
        two = _measure_scale(urls, args)
    finally:
        for p in procs:
            p.terminate()
        ray.get(plane.shutdown.remote(), timeout=60)
        ray.kill(plane, no_restart=True)
    print(
        json.dumps(
            {
                "bench": "gateway_scale",
                "workers": "2 colocated tiny, Ray actors of one control plane",
                "concurrency": args.concurrency,
                "max_tokens": 1,
                "one_gateway_requests_per_s": round(one["requests_per_s"], 1),
                "two_gateways_requests_per_s": round(two["requests_per_s"], 1),
                "ratio": round(two["requests_per_s"] / one["requests_per_s"], 3),
                "client_cpu_fraction": round(
                    max(one["client_cpu_fraction"], two["client_cpu_fraction"]), 2
                ),
                "cpu_count": os.cpu_count(),
            }
        ),
        flush=True,
    )


# -- served ------------------------------------------------------------------------------------


async def _serve_and_measure(workers: str, args: argparse.Namespace) -> dict[str, float]:
    import uvicorn

    from services.cluster.factories import EngineFactory
    from services.cluster.launchers import RayLauncher, launch_in_process
    from services.cluster.serve import bind_listener
    from services.cluster.specs import worker_specs
    from services.engine.loader import load_tokenizer
    from services.gateway.app import create_app
    from services.gateway.service import GatewayService, GatewaySettings

    config = _config(workers)
    specs = worker_specs(config, EngineFactory("embedded", config.model, config.engine), None)
    settings = GatewaySettings(config.gateway, config.router, config.model, "none")
    launcher = RayLauncher(num_cpus=0, num_gpus=0) if workers == "ray" else launch_in_process
    svc = GatewayService(settings, load_tokenizer(MODEL), specs, launcher)
    sock = bind_listener("127.0.0.1", 0)  # as ``baton serve`` binds (TCP_NODELAY)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(
        target=_client, args=(url, args.requests, args.concurrency, args.duration_s, out)
    )
    proc.start()
    while proc.is_alive() and out.empty():
        await asyncio.sleep(0.1)
    result = out.get(timeout=5)
    proc.join()
    server.should_exit = True
    await serving
    ttfts = result["ttfts"]
    return {
        "p50_ms": 1e3 * statistics.median(ttfts),
        "p99_ms": 1e3 * _percentile(ttfts, 0.99),
        "streams_per_s": result["streams_per_s"],
        "client_cpu_fraction": result["client_cpu_fraction"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--workers", choices=["inprocess", "ray", "both"], default="both")
    parser.add_argument(
        "--scale", action="store_true", help="only: one gateway process vs two, same workers"
    )
    args = parser.parse_args()
    if args.scale:
        scale(args)
        return

    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = baseline(args.requests, args.concurrency, args.duration_s)
    kinds = ["inprocess", "ray"] if args.workers == "both" else [args.workers]
    if "ray" in kinds:
        import ray

        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    for kind in kinds:
        served = asyncio.run(_serve_and_measure(kind, args))
        print(
            json.dumps(
                {
                    "bench": "gateway_ttft",
                    "workers": kind,
                    "prompt": PROMPT,
                    "requests": args.requests,
                    "p50_ms": round(served["p50_ms"], 3),
                    "p99_ms": round(served["p99_ms"], 3),
                    "baseline_p50_ms": round(base["p50_ms"], 3),
                    "baseline_p99_ms": round(base["p99_ms"], 3),
                    "added_p50_ms": round(served["p50_ms"] - base["p50_ms"], 3),
                    "added_p99_ms": round(served["p99_ms"] - base["p99_ms"], 3),
                    "baseline_gap_ms": 1e3 * GAP_S,
                    "baseline_hot_p50_ms": round(base["hot_p50_ms"], 3),
                    "added_over_hot_p50_ms": round(served["p50_ms"] - base["hot_p50_ms"], 3),
                    "added_over_hot_p99_ms": round(served["p99_ms"] - base["hot_p99_ms"], 3),
                }
            ),
            flush=True,
        )
        print(
            json.dumps(
                {
                    "bench": "gateway_throughput",
                    "workers": kind,
                    "concurrency": args.concurrency,
                    "max_tokens": 8,
                    "streams_per_s": round(served["streams_per_s"], 1),
                    "baseline_streams_per_s": round(base["streams_per_s"], 1),
                    "ratio": round(served["streams_per_s"] / base["streams_per_s"], 3),
                    "client_cpu_fraction": round(served["client_cpu_fraction"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
