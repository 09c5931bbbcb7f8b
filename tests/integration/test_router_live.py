"""The router's policies on a live cluster of real ``tiny`` workers.

* prefix affinity: engines report the hashes of their cached blocks in telemetry,
  the gateway hashes each prompt the same way, and ``prefix_aware`` sends
  prompts that share a long prefix to the worker that caches it.
* length-aware placement: 2 prefill + 2 decode Ray workers, one seeded open-loop
  workload of short and long prompts (45% long), run alternately under
  ``round_robin`` and ``slo_goodput`` on the same cluster. The engine schedules
  FCFS within a worker (a short prompt that arrives behind a long one waits for
  its prefill step), so ``slo_goodput`` runs with ``length_split: spatial``: long
  prompts go to one prefill worker and short ones never queue behind them.
  Under ``slo_goodput`` no short prompt is prefilled on a worker that prefilled
  a long one, and short requests' p90 TTFT is lower than under ``round_robin``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from router.types import Plan, RequestProfile
from services.engine.messages import SamplingParams
from services.gateway.errors import Overloaded, ServiceFailure
from services.gateway.service import GatewayService
from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

pytestmark = [pytest.mark.slow]

PREFIX = "".join(f"shared system prompt line {i}; " for i in range(12))  # ~330 byte tokens


@pytest.fixture(scope="module")
def two_mixed_prefix_aware() -> Iterator[ServedGateway]:
    config = tiny_config(
        **{
            "router.policy": "prefix_aware",
            "workers.mode": "colocated",
            "workers.prefill": 2,
            "workers.decode": 0,
        }
    )
    with ServedGateway(real_service(config, ray=False)) as server:
        yield server


def test_shared_prefix_lands_where_it_is_cached(two_mixed_prefix_aware: ServedGateway) -> None:
    server = two_mixed_prefix_aware
    svc = server.svc
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def run(request_id: str, text: str) -> tuple[str, int]:
        prompt = tuple(svc.tokenizer.encode(text))
        worker, cached = "", 0
        async for delta in svc.generate(request_id, prompt, sampling, time.monotonic()):
            worker = worker or delta.worker_id
            cached = max(cached, delta.num_cached_tokens)
        return worker, cached

    async def settle() -> None:
        await asyncio.sleep(0.3)  # the finish's telemetry (digest included) arrives

    # The tie-break winner when both are idle is the first worker of the view: load it,
    # so that the first prompt goes to the other one, then unload it.
    first_choice = svc.router.view().workers[0].worker_id
    svc.router.reserve(RequestProfile("load", 100_000, 100_000, 1), Plan(first_choice, None))
    home, _ = server.call(run("seed", PREFIX + "question zero?"))
    svc.router.release("load")
    assert home != first_choice
    server.call(settle())

    assert svc.router.view().workers  # both idle again: only affinity separates them
    digests = {w.worker_id: w.prefix_digest for w in svc.router.view().workers}
    assert len(digests[home]) >= len(PREFIX) // 16 and not digests[first_choice]
    for i in range(4):
        worker, cached = server.call(run(f"follow-{i}", PREFIX + f"question {i + 1}?"))
        assert worker == home, (i, worker)
        assert cached >= (len(PREFIX) // 16) * 16 - 16  # the shared blocks were reused
        server.call(settle())


# -- length-aware placement ------------------------------------------------------------

SEED = 7
RATE_PER_S = 48.0
NUM_REQUESTS = 160  # per phase: ~3.3 s of arrivals
LONG_FRACTION = 0.45
SHORT_TOKENS = (16, 64)
LONG_TOKENS = (1700, 2000)
PHASES = ("round_robin", "slo_goodput") * 3


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # after the phase starts
    num_tokens: int
    long: bool
    seed: int  # of the prompt's token ids


def mixed_workload(seed: int) -> list[Arrival]:
    """Poisson arrivals; the same list (lengths, times) for every phase."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / RATE_PER_S, NUM_REQUESTS)
    long = rng.random(NUM_REQUESTS) < LONG_FRACTION
    lo = np.where(long, LONG_TOKENS[0], SHORT_TOKENS[0])
    hi = np.where(long, LONG_TOKENS[1], SHORT_TOKENS[1])
    lens = rng.integers(lo, hi + 1)
    return [
        Arrival(float(t), int(n), bool(is_long), int(s))
        for t, n, is_long, s in zip(
            np.cumsum(gaps), lens, long, rng.integers(0, 2**31, NUM_REQUESTS), strict=True
        )
    ]


def prompt_ids(arrival: Arrival, salt: int, vocab: int) -> tuple[int, ...]:
    """Random ids, different in every phase (``salt``) so no phase hits another's cache."""
    rng = np.random.default_rng([arrival.seed, salt])
    return tuple(int(t) for t in rng.integers(3, vocab, arrival.num_tokens))


async def run_phase(
    svc: GatewayService, arrivals: list[Arrival], salt: int
) -> list[tuple[float, str]]:
    """Open loop: submit each request at its time; per request its TTFT (inf if
    rejected) and the worker that sent its first token (where it was prefilled), or
    why it was rejected (its error, from ``at_s`` into the phase)."""
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    vocab = 250  # byte tokenizer: plain byte values

    async def one(i: int, a: Arrival) -> tuple[float, str]:
        prompt = prompt_ids(a, salt, vocab)
        arrival_s = time.monotonic()
        ttft_s, worker = float("inf"), ""
        try:
            async for delta in svc.generate(f"p{salt}-{i}", prompt, sampling, arrival_s):
                if ttft_s == float("inf"):
                    ttft_s, worker = time.monotonic() - arrival_s, delta.worker_id
        except (Overloaded, ServiceFailure) as e:  # counted as never served
            worker = f"{type(e).__name__} at {a.at_s:.2f} s: {e}"
        return ttft_s, worker

    start_s = time.monotonic()
    tasks = []
    for i, a in enumerate(arrivals):
        delay_s = start_s + a.at_s - time.monotonic()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        tasks.append(asyncio.create_task(one(i, a)))
    return list(await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def two_prefill_two_decode(ray_cluster: str) -> Iterator[ServedGateway]:
    config = tiny_config(
        **{
            "workers.prefill": 2,
            "workers.decode": 2,
            "kvtransfer.backend": "nixl",
            "kvtransfer.lease_s": 30.0,  # round_robin queues can outlast the 2 s test lease
            "kvtransfer.transfer_timeout_s": 10.0,
            "router.policy": "slo_goodput",
            "router.length_split": "spatial",
            "router.length_threshold_tokens": 512,
            "router.default_slo.ttft_ms": 1000.0,
            "router.max_hold_s": 1.0,
            "router.rebalance_interval_s": 3600.0,  # no role flips mid-measurement
        }
    )
    with ServedGateway(real_service(config, ray=True)) as server:
        yield server


@pytest.mark.ray
def test_short_prompts_p90_ttft_lower_under_slo_goodput_than_round_robin(
    two_prefill_two_decode: ServedGateway,
) -> None:
    server = two_prefill_two_decode
    svc = server.svc
    arrivals = mixed_workload(SEED)
    assert svc.router.settings.policy == "slo_goodput"
    # Warm up every worker (first steps allocate) under the measured policies.
    for name in ("round_robin", "slo_goodput"):
        svc.executor.use_policy(name)
        server.call(run_phase(svc, arrivals[:40], salt=100 + len(name)), timeout_s=60)

    short: dict[str, list[float]] = {"round_robin": [], "slo_goodput": []}
    refused: list[str] = []  # short requests', by phase
    prefilled_on: dict[bool, set[str]] = {True: set(), False: set()}  # long? -> workers
    for salt, name in enumerate(PHASES):
        svc.executor.use_policy(name)
        results = server.call(run_phase(svc, arrivals, salt), timeout_s=120)
        short[name] += [t for (t, _), a in zip(results, arrivals, strict=True) if not a.long]
        refused += [
            f"{name} phase {salt}: {why}"
            for (t, why), a in zip(results, arrivals, strict=True)
            if not a.long and t == float("inf")
        ]
        if name == "slo_goodput":
            for (t, worker), a in zip(results, arrivals, strict=True):
                if t < float("inf"):
                    prefilled_on[a.long].add(worker)
    p90 = {name: float(np.percentile(v, 90)) for name, v in short.items()}
    p50 = {name: float(np.percentile(v, 50)) for name, v in short.items()}
    print(json.dumps({"short_p90_ttft_s": p90, "short_p50_ttft_s": p50}))  # seen with -s
    assert not refused, refused
    # The mechanism, exactly: under the spatial split no short prompt was prefilled
    # where long ones were, so none could queue behind one.
    assert prefilled_on[True] and not prefilled_on[True] & prefilled_on[False], prefilled_on
    # Its effect, as the issue states it: round_robin's p90 was 1.9-2.1x slo_goodput's
    # in three runs on 2 shared cores. A 2000-token prefill takes ~13 ms here, so long
    # prompts are 45% of the mix: under round_robin they hold each prefill worker ~15%
    # of the time, enough to reach the short prompts' p90 (at 25% they did not).
    assert p90["slo_goodput"] < p90["round_robin"], p90
