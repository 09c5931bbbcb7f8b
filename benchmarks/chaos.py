"""Faults under load: the tiny cluster (2 gateways; 2 prefill + 2 decode) serves a seeded
open-loop load while workers, a gateway and the controller are SIGKILLed.

The seeded load runs under this schedule of faults, one at a time (each waits until the
cluster is back at full strength), for as long as the schedule takes; then the same
jobs run again undisturbed on the same cluster (the baseline texts):

    prefill_during_transfer   SIGKILL a prefill worker while it holds KV for a transfer
    decode_mid_stream         SIGKILL a decode worker with requests running
    three_workers_in_2s       SIGKILL three workers within two seconds
    gateway                   SIGKILL one gateway process (its open streams end in an
                              error; its later requests go to the other gateway, as a
                              Service would send them)
    controller                SIGKILL the controller actor's process (Ray restarts it,
                              it adopts the live workers)

Prints one JSON line: requests sent, completed, lost (no response and no error),
client errors by cause, texts differing from the undisturbed run, time to full
strength after each fault (seconds until the controller again lists four ready
workers: p50, p99), and KV blocks still used or held on the workers after the run.

Usage: ``python benchmarks/chaos.py [--rate 4] [--seed 0]`` (``make bench-chaos``)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
ROOT = _HERE.parent

MODEL = "tiny"
LEASE_S = 2.0
NUM_WORKERS = 4
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "hum",
]


@dataclass(frozen=True, slots=True)
class Job:
    index: int
    at_s: float
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    text: str | None = None  # None: no complete answer
    error: str | None = None


@dataclass(slots=True)
class Run:
    jobs: list[Job]
    outcomes: list[Outcome]
    faults: Any  # FaultLog


def workload(rate_per_s: float, seed: int) -> Iterator[Job]:
    """Poisson arrivals, without end; prompts and lengths drawn from ``seed``."""
    rng = random.Random(seed)
    t = 0.0
    for i in itertools.count():
        t += rng.expovariate(rate_per_s)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120)))
        yield Job(i, t, f"request {i}: {words}", rng.randint(16, 96))


# -- the client ------------------------------------------------------------------------------


async def _send(client: Any, url: str, job: Job) -> Outcome:
    import httpx

    body = {
        "model": MODEL,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    text = ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(error=f"http_{r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return Outcome(text=text)
                event = json.loads(data)
                if "error" in event:
                    return Outcome(error="stream_error_event")
                text += "".join(c.get("text", "") for c in event.get("choices", []))
        return Outcome(error="stream_ended_without_done")
    except httpx.ConnectError:
        return Outcome(error="connect_refused")
    except httpx.TimeoutException:
        return Outcome()  # lost: neither an answer nor an error in time
    except httpx.TransportError as e:
        return Outcome(error=f"transport_{type(e).__name__}")


async def run_load(
    jobs: Iterable[Job], urls: list[str], dead: set[str], stop: asyncio.Event | None = None
) -> tuple[list[Job], list[Outcome]]:
    """Open loop: job i is sent at its time to gateway i % 2 (until ``stop`` is set); a
    request refused by a dead gateway before any byte goes to the other one (what a
    Service does). Returns the jobs sent and their outcomes."""
    import httpx

    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        start = time.monotonic()

        async def one(job: Job) -> Outcome:
            url = urls[job.index % len(urls)]
            if url in dead:
                url = next(u for u in urls if u not in dead)
            outcome = await _send(client, url, job)
            if outcome.error == "connect_refused":
                dead.add(url)
                other = next(u for u in urls if u not in dead)
                outcome = await _send(client, other, job)
            return outcome

        sent: list[Job] = []
        tasks: list[asyncio.Task[Outcome]] = []
        for job in jobs:
            await asyncio.sleep(max(0.0, start + job.at_s - time.monotonic()))
            if stop is not None and stop.is_set():
                break
            sent.append(job)
            tasks.append(asyncio.create_task(one(job)))
        return sent, list(await asyncio.gather(*tasks))


# -- the cluster -------------------------------------------------------------------------------


class Gateway:
    def __init__(self, ray_address: str) -> None:
        from loadgen.server_proc import child_env, free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--ray-address", ray_address,
             "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"],
            cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        from loadgen.server_proc import wait_until_serving

        wait_until_serving(self.url, self.proc, timeout_s)

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def _config() -> Any:
    from services.config import ClusterConfig

    return ClusterConfig().with_overrides(
        {
            "model.name": MODEL,
            "engine.device": "cpu",
            "engine.num_threads": 1,
            "engine.kv_cache_bytes": 16 * 2**20,
            "workers.prefill": 2,
            "workers.decode": 2,
            "workers.num_cpus": 0,
            "kvtransfer.backend": "nixl",
            "kvtransfer.lease_s": LEASE_S,
            "kvtransfer.transfer_timeout_s": 5.0,
            "router.policy": "round_robin",
            # New arrivals wait for room while workers are being replaced, rather than
            # being turned away (a re-planned request is never refused for its age).
            "router.max_hold_s": 30.0,
        }
    )


async def _workers(plane: Any) -> dict[str, Any]:
    """worker id -> (role, actor handle), as the controller lists them now."""
    import ray

    from services.cluster.control_plane import NAMESPACE

    registry = await plane.registry.remote()
    out = {}
    for w in registry.workers:
        try:
            out[w.worker_id] = (w.role.value, ray.get_actor(w.actor_name, namespace=NAMESPACE))
        except ValueError:
            continue
    return out


async def _pid(actor: Any) -> int:
    pid: int = await actor.__ray_call__.remote(lambda self: os.getpid())
    return pid


async def _sigkill_actor(actor: Any) -> None:
    os.kill(await _pid(actor), signal.SIGKILL)


async def _full_strength_after(plane: Any, killed: set[str], deadline_s: float = 120.0) -> float:
    """Seconds until the controller lists NUM_WORKERS ready workers, none of them killed."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            registry = await asyncio.wait_for(plane.registry.remote(), 2.0)
            ids = {w.worker_id for w in registry.workers}
            if registry.ready and len(ids) == NUM_WORKERS and not ids & killed:
                return time.monotonic() - t0
        except Exception:  # the controller restarting
            pass
        await asyncio.sleep(0.05)
    return float("inf")


async def _pick(plane: Any, role: str, busy: str, timeout_s: float = 5.0) -> tuple[str, Any, bool]:
    """A worker of ``role`` that is busy now (``held``: holds KV for a transfer;
    ``running``: has requests running), or any of that role after ``timeout_s``; and
    whether it was busy."""
    t0 = time.monotonic()
    while True:
        workers = await _workers(plane)
        candidates = [(wid, a) for wid, (r, a) in workers.items() if r == role]
        for wid, actor in candidates:
            s = await actor.snapshot.remote()
            if (busy == "held" and s.num_held_blocks > 0) or (busy == "running" and s.running):
                return wid, actor, True
        if time.monotonic() - t0 > timeout_s and candidates:
            return (*candidates[0], False)
        await asyncio.sleep(0.01)


@dataclass(slots=True)
class FaultLog:
    full_strength_s: dict[str, float] = field(default_factory=dict)
    victim_was_busy: dict[str, bool] = field(default_factory=dict)
    fired_at_s: dict[str, float] = field(default_factory=dict)


async def faults(
    plane: Any, gateways: list[Gateway], dead: set[str], settle_s: float = 3.0
) -> FaultLog:
    """The schedule, one fault at a time: each waits for the cluster to be back at full
    strength (timed) and ``settle_s`` more, so the times do not overlap."""
    log = FaultLog()
    t0 = time.monotonic()

    async def killed(name: str, victims: set[str]) -> None:
        log.fired_at_s[name] = round(time.monotonic() - t0, 2)
        log.full_strength_s[name] = await _full_strength_after(plane, victims)
        await asyncio.sleep(settle_s)

    await asyncio.sleep(4.0)
    wid, actor, log.victim_was_busy["prefill_during_transfer"] = await _pick(
        plane, "prefill", "held"
    )
    await _sigkill_actor(actor)
    await killed("prefill_during_transfer", {wid})

    wid, actor, log.victim_was_busy["decode_mid_stream"] = await _pick(plane, "decode", "running")
    await _sigkill_actor(actor)
    await killed("decode_mid_stream", {wid})

    victims = list((await _workers(plane)).items())[:3]
    for _, (_, actor) in victims:
        await _sigkill_actor(actor)
        await asyncio.sleep(0.8)  # three within two seconds
    await killed("three_workers_in_2s", {w for w, _ in victims})

    dead.add(gateways[1].url)
    await asyncio.to_thread(gateways[1].sigkill)
    log.fired_at_s["gateway"] = round(time.monotonic() - t0, 2)
    await asyncio.sleep(settle_s)

    await _sigkill_actor(plane)
    await killed("controller", set())
    return log


async def _blocks_in_use(plane: Any) -> int:
    total = 0
    for _, actor in (await _workers(plane)).values():
        s = await actor.snapshot.remote()
        total += s.num_used_blocks + s.num_held_blocks
    return total


# -- main ----------------------------------------------------------------------------------------


async def _disturbed(jobs: Iterable[Job], plane: Any, gateways: list[Gateway]) -> Run:
    dead: set[str] = set()
    stop = asyncio.Event()
    load = asyncio.create_task(run_load(jobs, [g.url for g in gateways], dead, stop))
    log = await faults(plane, gateways, dead)
    stop.set()
    sent, outcomes = await load
    return Run(sent, outcomes, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

    from services.cluster.control_plane import NAMESPACE, start_control_plane

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    plane = start_control_plane(_config())
    ray.get(plane.start.remote(), timeout=300)
    gateways = [Gateway(address) for _ in range(2)]
    try:
        for g in gateways:
            g.wait_ready()
        # Under faults first, for as long as the schedule takes; then the same jobs (same
        # seed, same times) undisturbed, with the killed gateway started again.
        run = asyncio.run(_disturbed(workload(args.rate, args.seed), plane, gateways))
        time.sleep(LEASE_S + 1.0)
        blocks = asyncio.run(_blocks_in_use(plane))
        gateways[1] = Gateway(address)
        gateways[1].wait_ready()
        _, baseline = asyncio.run(run_load(run.jobs, [g.url for g in gateways], set()))
    finally:
        for g in gateways:
            if g.proc.poll() is None:
                g.proc.terminate()
        handle = ray.get_actor("baton-controller", namespace=NAMESPACE)
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle, no_restart=True)
    outcomes = run.outcomes
    errors = Counter(o.error for o in outcomes if o.error)
    lost = sum(1 for o in outcomes if o.text is None and o.error is None)
    differing = sum(
        1
        for o, b in zip(outcomes, baseline, strict=True)
        if o.text is not None and b.text is not None and o.text != b.text
    )
    times = sorted(run.faults.full_strength_s.values())
    print(
        json.dumps(
            {
                "bench": "chaos",
                "seed": args.seed,
                "requests_sent": len(run.jobs),
                "completed": sum(1 for o in outcomes if o.text is not None),
                "lost": lost,
                "client_errors": dict(errors),
                "differing_texts": differing,
                "baseline_completed": sum(1 for b in baseline if b.text is not None),
                "baseline_client_errors": dict(Counter(b.error for b in baseline if b.error)),
                "faults_fired_at_s": run.faults.fired_at_s,
                "victim_was_busy": run.faults.victim_was_busy,
                "full_strength_s": {k: round(v, 2) for k, v in run.faults.full_strength_s.items()},
                "full_strength_p50_s": round(statistics.median(times), 2),
                "full_strength_p99_s": round(
                    times[min(len(times) - 1, round(0.99 * (len(times) - 1)))], 2
                ),
                "blocks_in_use_after": blocks,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
