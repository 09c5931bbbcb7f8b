"""Router decision time vs cluster size (``make bench-router``).

For clusters of 8, 64 and 1024 workers (half prefill, half decode, 64 running
requests per decode worker), time ``policy.plan`` for every registered policy in
three scenarios:

* ``steady``: the same ``ClusterView`` for every decision (the per-snapshot caches
  are warm);
* ``blocks_changed``: before each decision one worker's snapshot changes in its
  queue/free blocks only (the running set is the same object);
* ``one_reported``: before each decision one worker reports after a decode step:
  every running request is one token longer (new objects), so its row, including
  the past-future draws, is recomputed inside the timed decision;
* ``live``: the gateway's path, through ``router.Router``: every worker sends a
  ``WorkerSnapshot`` at 10 Hz (after a decode step: new running objects), interleaved
  with ``--rate`` decisions per second; each timed decision includes the ``update``
  calls that arrived since the previous one (view maintenance, amortised) and, as the
  gateway does at its workers' first events, ``release(id, worker)`` on each worker
  of the request placed 8 decisions earlier (its decode part then stays reserved
  until that worker's next report counts it), and the output length of one request
  that ended (``observe_outcome``: in the steady state one ends per decision).

Prints one JSON line per (policy, workers, scenario) with p50/p99 in µs and the
ratio of p99 to ``round_robin``'s (the baseline, measured in the same run).

Each sequence of decisions is replayed ``--rounds`` times with a fresh policy;
the policies are deterministic, so decision ``k`` does the same work every round,
and its time is the minimum over rounds (other processes on a shared machine
only add time; a preempted decision is slow in one round, not in all).
``p99_raw_us`` is the p99 of the best single round, noise included. The exit
status is 1 when slo_goodput misses its p99 target in the steady or the live
scenario (``make bench`` still runs the other benchmarks, then says so).

``--clock cpu`` (the default) times each decision with this thread's CPU clock
(``time.thread_time_ns``): on a shared 2-core machine the wall clock also counts
the milliseconds the process waits while another one runs, which is what made the
p99 of earlier runs (5-10 ms at 64 workers) a measure of the machine, not of the
router. ``--clock wall`` keeps ``perf_counter_ns`` for a quiet machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder leads sys.path and its name shadows the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

from router import Router, RouterSettings, available_policies, make_policy  # noqa: E402
from router.types import (  # noqa: E402
    ClusterView,
    LengthClass,
    Plan,
    Priority,
    RequestProfile,
    Role,
    RunningRequest,
    WorkerView,
)
from services.workers.messages import WorkerSnapshot  # noqa: E402

BASELINE = "round_robin"
TARGETS_P99_US = {64: 100.0, 1024: 1000.0}  # slo_goodput's targets
SCENARIOS = ("steady", "blocks_changed", "one_reported", "live")
SNAPSHOT_HZ = 10.0
ACK_AFTER = 8  # decisions between a placement and its release


def make_worker(rng: random.Random, index: int, role: Role, num_running: int) -> WorkerView:
    running = tuple(
        RunningRequest(
            num_tokens_held=rng.randint(64, 2048) + (g := rng.randint(0, 400)),
            num_generated=g,
            max_tokens=rng.choice((512, 1024, 2048)),
        )
        for _ in range(num_running if role is Role.DECODE else 0)
    )
    total_blocks = rng.randint(9000, 14000)
    used = sum(r.num_tokens_held for r in running) // 16 + 1
    queued_short = rng.randint(0, 4) if role is Role.PREFILL else 0
    queued_long = rng.randint(0, 2) if role is Role.PREFILL else 0
    return WorkerView(
        worker_id=f"w{index:04d}",
        role=role,
        num_total_blocks=total_blocks,
        num_free_blocks=max(0, total_blocks - used),
        queued_tokens={
            LengthClass.SHORT: queued_short * 150,
            LengthClass.LONG: queued_long * 3000,
        },
        queued_requests={LengthClass.SHORT: queued_short, LengthClass.LONG: queued_long},
        running=running,
        prefix_digest=frozenset(rng.randrange(512) for _ in range(32)),
        link_bandwidth_bytes_per_s=rng.choice((12.5e9, 25e9)),
        kv_bytes_per_token=131072,
    )


def make_view(rng: random.Random, num_workers: int) -> ClusterView:
    roles = [Role.PREFILL if i % 2 == 0 else Role.DECODE for i in range(num_workers)]
    workers = tuple(make_worker(rng, i, role, 64) for i, role in enumerate(roles))
    lens = tuple(int(v) for v in np.random.default_rng(1).lognormal(5.0, 1.0, 200))
    return ClusterView(workers=workers, recent_output_lens=lens)


def make_requests(rng: random.Random, count: int) -> list[RequestProfile]:
    out = []
    for i in range(count):
        prompt = min(16000, int(rng.lognormvariate(6.0, 1.2)) + 1)
        hashes = tuple(rng.randrange(512) for _ in range(min(prompt // 16, 8)))
        out.append(
            RequestProfile(
                request_id=f"r{i}",
                num_prompt_tokens=prompt,
                num_new_tokens=prompt,
                max_tokens=rng.choice((256, 1024)),
                priority=Priority.BATCH if rng.random() < 0.2 else Priority.INTERACTIVE,
                prefix_hashes=hashes,
            )
        )
    return out


def perturb(rng: random.Random, view: ClusterView, step: bool) -> ClusterView:
    """One worker reports a new snapshot; with ``step``, after one decode step."""
    workers = list(view.workers)
    i = rng.randrange(len(workers))
    w = workers[i]
    free = max(0, min(w.num_total_blocks, w.num_free_blocks + rng.randint(-4, 4)))
    running = w.running
    if step:
        running = tuple(
            RunningRequest(r.num_tokens_held + 1, r.num_generated + 1, r.max_tokens)
            for r in running
        )
    workers[i] = dataclasses.replace(w, num_free_blocks=free, running=running)
    return ClusterView(workers=tuple(workers), recent_output_lens=view.recent_output_lens)


def time_policy(
    name: str,
    view: ClusterView,
    requests: list[RequestProfile],
    scenario: str,
    seed: int,
    rounds: int,
    rate: float,
    clock: Callable[[], int],
) -> tuple[float, float, float]:
    """(p50, p99) of the per-decision minimum over rounds, and the best round's raw p99."""
    runs = np.stack(
        [time_round(name, view, requests, scenario, seed, rate, clock) for _ in range(rounds)]
    )
    p50, p99 = np.percentile(runs.min(axis=0), [50, 99])
    raw_p99 = min(float(np.percentile(run, 99)) for run in runs)
    return float(p50), float(p99), raw_p99


def time_round(
    name: str,
    view: ClusterView,
    requests: list[RequestProfile],
    scenario: str,
    seed: int,
    rate: float,
    clock: Callable[[], int],
) -> np.ndarray:
    """Microseconds per decision."""
    if scenario == "live":
        return time_live_round(name, view, requests, rate, clock)
    policy = make_policy(name)
    rng = random.Random(seed)
    policy.plan(requests[0], view, 0.0)  # builds the per-snapshot caches
    if scenario == "steady":
        views = [view] * len(requests)
    else:
        views = [perturb(rng, view, step=scenario == "one_reported") for _ in requests]
    times_ns = np.empty(len(requests))
    for k, (request, v) in enumerate(zip(requests, views)):
        start = clock()
        policy.plan(request, v, 0.0)
        times_ns[k] = clock() - start
    return times_ns / 1e3


def snapshot_of(w: WorkerView, seq: int) -> WorkerSnapshot:
    waiting = (150,) * w.queued_requests.get(LengthClass.SHORT, 0) + (3000,) * (
        w.queued_requests.get(LengthClass.LONG, 0)
    )
    return WorkerSnapshot(
        worker_id=w.worker_id,
        role=w.role,
        draining=False,
        seq=seq,
        time_s=seq / SNAPSHOT_HZ,
        block_size=w.block_size,
        num_total_blocks=w.num_total_blocks,
        num_free_blocks=w.num_free_blocks,
        num_cached_blocks=0,
        num_held_blocks=0,
        running=w.running,
        waiting_prompt_lens=waiting,
        recent_steps=(),
        recent_output_lens=(),
        num_preemptions=0,
        num_pending_pulls=0,
        num_finished_requests=0,
        kv_bytes_per_token=w.kv_bytes_per_token,
        max_num_seqs=w.max_num_seqs,
        max_model_len=32768,
        prefix_digest=tuple(sorted(w.prefix_digest)),
    )


def time_live_round(
    name: str,
    view: ClusterView,
    requests: list[RequestProfile],
    rate: float,
    clock: Callable[[], int],
) -> np.ndarray:
    """Microseconds per decision through ``Router``, snapshots and releases included."""
    router = Router(RouterSettings(policy=name))
    workers = list(view.workers)
    for w in workers:
        router.update(snapshot_of(w, 1))
    router.observe_outcome(200)
    router.place(requests[0], 0.0)  # builds the per-snapshot caches
    router.release(requests[0].request_id)
    # Snapshots due before each decision, built outside the timed region: workers report
    # in turn, each after one decode step (every running request one token longer).
    per_decision = len(workers) * SNAPSHOT_HZ / rate
    due: list[list[WorkerSnapshot]] = []
    sent = 0
    for k in range(len(requests)):
        batch = []
        while sent < int((k + 1) * per_decision):
            i = sent % len(workers)
            w = workers[i] = dataclasses.replace(
                workers[i],
                running=tuple(
                    RunningRequest(r.num_tokens_held + 1, r.num_generated + 1, r.max_tokens)
                    for r in workers[i].running
                ),
            )
            batch.append(snapshot_of(w, 2 + sent // len(workers)))
            sent += 1
        due.append(batch)
    # In the steady state a request ends per decision: its output length, drawn as the
    # view's history was, reaches the router's estimator history (``observe_outcome``).
    output_lens = np.random.default_rng(2).lognormal(5.0, 1.0, len(requests)).astype(int)
    times_ns = np.empty(len(requests))
    placed: list[tuple[str, tuple[str, ...]]] = []
    for k, request in enumerate(requests):
        now_s = k / rate
        request = dataclasses.replace(request, arrival_s=now_s)
        start = clock()
        for snap in due[k]:
            router.update(snap)
        router.observe_outcome(int(output_lens[k]))
        decision = router.place(request, now_s)
        workers_of = decision.text_workers if isinstance(decision, Plan) else ()
        placed.append((request.request_id, workers_of))
        if k >= ACK_AFTER:  # its workers' first events, as the gateway reports them
            request_id, started_on = placed[k - ACK_AFTER]
            for worker_id in started_on:
                router.release(request_id, worker_id)
        times_ns[k] = clock() - start
    return times_ns / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="*", default=[8, 64, 1024])
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--scenarios", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0, help="live: decisions per second")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this thread's CPU time per decision (a shared machine's waits left out)",
    )
    args = parser.parse_args()
    clock = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    policies = [BASELINE] + [p for p in available_policies() if p != BASELINE]
    failed = False
    for num_workers in args.workers:
        rng = random.Random(args.seed)
        view = make_view(rng, num_workers)
        requests = make_requests(rng, args.decisions)
        for scenario in args.scenarios:
            baseline_p99 = None
            for name in policies:
                p50, p99, raw_p99 = time_policy(
                    name, view, requests, scenario, args.seed, args.rounds, args.rate, clock
                )
                baseline_p99 = baseline_p99 or p99
                row = {
                    "policy": name,
                    "workers": num_workers,
                    "scenario": scenario,
                    "p50_us": round(p50, 1),
                    "p99_us": round(p99, 1),
                    "p99_raw_us": round(raw_p99, 1),
                    "baseline": BASELINE,
                    "p99_vs_baseline": round(p99 / baseline_p99, 2),
                    "clock": args.clock,
                }
                target = TARGETS_P99_US.get(num_workers)
                if name == "slo_goodput" and target is not None:
                    row["target_p99_us"] = target
                    row["meets_target"] = p99 < target
                    failed |= scenario in ("steady", "live") and p99 >= target
                print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
