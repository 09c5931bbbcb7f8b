"""The router's policies on a live cluster of real ``tiny`` workers.

* prefix affinity: engines report the hashes of their cached blocks in telemetry,
  the gateway hashes each prompt the same way, and ``prefix_aware`` sends
  prompts that share a long prefix to the worker that caches it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from services.engine.messages import SamplingParams
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
    first_choice = svc.state.view().workers[0].worker_id
    load = svc.state.reserve(first_choice, 100_000, 1, prefill=True)
    home, _ = server.call(run("seed", PREFIX + "question zero?"))
    svc.state.release(load)
    assert home != first_choice
    server.call(settle())

    assert svc.state.view().workers  # both idle again: only affinity separates them
    digests = {w.worker_id: w.prefix_digest for w in svc.state.view().workers}
    assert len(digests[home]) >= len(PREFIX) // 16 and not digests[first_choice]
    for i in range(4):
        worker, cached = server.call(run(f"follow-{i}", PREFIX + f"question {i + 1}?"))
        assert worker == home, (i, worker)
        assert cached >= (len(PREFIX) // 16) * 16 - 16  # the shared blocks were reused
        server.call(settle())
