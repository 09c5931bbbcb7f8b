"""Hostile requests mixed into normal traffic: what they cost the normal traffic.

One run, one server (``baton serve``, the tiny model, 2 prefill + 2 decode Ray
workers, an API key from the environment): a normal ``baton bench`` load alone
(the baseline), then the same load with the hostile probes of issue 18 (top_k 2^63,
logit_bias out of range, 1,000 prompts x n=16, 200 KB stop strings, bad tokens,
NaN, deep JSON, oversized bodies and headers, non-ASCII keys, half-sent headers)
sent at a steady trickle beside it. Prints one JSON line:

    {"bench": "abuse", "clean": {...}, "abused": {...},
     "p99_ttft_ratio", "goodput_ratio",            # targets: <= 1.2, >= 0.9
     "probes_sent", "probe_5xx", "probe_hangs", "normal_failed", "worker_restarts",
     "targets_met"}

Usage: ``python benchmarks/abuse.py [--rate 4] [--num-requests 120] [--probe-rate 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, and benchmarks/kvtransfer.py
# would shadow the kvtransfer package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

KEY = "abuse-bench-key"
HANG_S = 5.0  # a probe unanswered this long counts as a hang


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


# (path, JSON body or raw bytes, extra headers)
PROBES: list[tuple[str, Any, dict[str, Any]]] = [
    ("completions", _completion(top_k=2**63, temperature=1), {}),
    ("completions", _completion(logit_bias={"99999999": 1, str(2**63): 1e30}), {}),
    ("completions", _completion(prompt=["p"] * 1000, n=16), {}),
    ("chat/completions", _chat(stop=["s" * 200_000] * 16, n=16), {}),
    ("completions", _completion(prompt=[10**9]), {}),
    ("completions", _completion(max_tokens=10**12), {}),
    ("completions", b'{"model":"tiny","prompt":"hi","temperature":NaN}', {}),
    ("completions", b"[" * 100_000 + b"]" * 100_000, {}),
    ("completions", b"x" * (5 * 2**20), {}),
    ("completions", _completion(), {"Authorization": b"Bearer \xff\xfe"}),
    ("completions", _completion(), {"X-Pad": "p" * 65536}),
    ("chat/completions", _chat(top_k=10**6, n=16), {}),
]


# Encoded once, here: encoding megabytes per probe would load the benchmark's own event
# loop, which also times the normal traffic.
_ENCODED = [
    (path, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
    for path, body, headers in PROBES
]


async def _probe(client: Any, base: str, path: str, body: bytes, headers: dict[str, Any]) -> int:
    hdrs = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
    r = await client.post(f"{base}/v1/{path}", content=body, headers=hdrs)
    return int(r.status_code)


async def _half_header(host: str, port: int) -> None:
    """A connection that sends half a request header and waits (slowloris)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(), 60)  # the server closes it
    finally:
        writer.close()


async def _trickle(base: str, port: int, rate: float, stop: asyncio.Event) -> dict[str, int]:
    import httpx

    counts = {"probes_sent": 0, "probe_5xx": 0, "probe_hangs": 0, "probe_4xx": 0}
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(timeout=HANG_S) as client:

        async def one(i: int) -> None:
            path, body, headers = _ENCODED[i % len(_ENCODED)]
            try:
                if i % (len(PROBES) + 1) == len(PROBES):
                    await _half_header("127.0.0.1", port)
                    return
                status = await _probe(client, base, path, body, headers)
            except httpx.TimeoutException:
                counts["probe_hangs"] += 1
                return
            except httpx.TransportError:
                return  # the server closed an abusive connection: fine
            counts["probe_5xx" if status >= 500 else "probe_4xx"] += 1

        i = 0
        while not stop.is_set():
            counts["probes_sent"] += 1
            task = asyncio.create_task(one(i))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*pending, return_exceptions=True)
    return counts


async def _bench(base: str, args: argparse.Namespace) -> dict[str, Any]:
    from loadgen.arrivals import parse_rate
    from loadgen.client import BenchConfig, run_bench_async
    from loadgen.metrics import GoodputSLO
    from loadgen.scenario import WorkloadConfig

    config = BenchConfig(
        base_url=base,
        workload=WorkloadConfig(
            input_len="uniform:32-256", output_len="32", num_requests=args.num_requests, seed=1
        ),
        rate=parse_rate(str(args.rate)),
        slo=GoodputSLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms),
        api_key=KEY,
        timeout_s=120,
    )
    result = await run_bench_async(config)
    s = result.summary
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "p99_ttft_ms": s["p99_ttft_ms"],
        "median_ttft_ms": s["median_ttft_ms"],
        "request_goodput": s["request_goodput"],
    }


async def _restarts(base: str) -> int:
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        workers = (await client.get(f"{base}/ready")).json()["workers"]
    return sum(1 for w in workers if ".r" in w["worker_id"] or w["state"] == "down")


async def _measure(base: str, port: int, args: argparse.Namespace) -> dict[str, Any]:
    await _bench(base, argparse.Namespace(**{**vars(args), "num_requests": 10}))  # warm-up
    clean = await _bench(base, args)
    stop = asyncio.Event()
    trickle = asyncio.create_task(_trickle(base, port, args.probe_rate, stop))
    abused = await _bench(base, args)
    stop.set()
    counts = await trickle
    restarts = await _restarts(base)
    ttft_ratio = abused["p99_ttft_ms"] / max(clean["p99_ttft_ms"], 1e-9)
    goodput_ratio = abused["request_goodput"] / max(clean["request_goodput"], 1e-9)
    return {
        "bench": "abuse",
        "clean": clean,
        "abused": abused,
        "p99_ttft_ratio": round(ttft_ratio, 3),
        "goodput_ratio": round(goodput_ratio, 3),
        **counts,
        "normal_failed": abused["failed"],
        "worker_restarts": restarts,
        "targets_met": ttft_ratio <= 1.2
        and goodput_ratio >= 0.9
        and counts["probe_5xx"] == 0
        and counts["probe_hangs"] == 0
        and abused["failed"] == 0
        and restarts == 0,
    }


def main() -> None:
    from urllib.parse import urlsplit

    from loadgen.server_proc import child_env, start_baton, stop

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=4.0, help="normal requests per second")
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--probe-rate", type=float, default=4.0, help="hostile probes per second")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-ms", type=float, default=200.0)
    parser.add_argument("--ready-s", type=float, default=300.0)
    args = parser.parse_args()
    serve = ["serve", "--model", "tiny", "--prefill", "2", "--decode", "2", "--worker-cpus", "0"]
    server, base = start_baton(
        serve, env=child_env(BATON_API_KEY=KEY), timeout_s=args.ready_s, path="/health"
    )
    try:
        print(json.dumps(asyncio.run(_measure(base, urlsplit(base).port, args))), flush=True)
    finally:
        stop(server)


if __name__ == "__main__":
    main()
