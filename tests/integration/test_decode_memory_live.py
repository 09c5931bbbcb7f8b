"""Decode memory is protected under every policy: a live 1 prefill + 1 decode tiny cluster
whose KV pools hold a fraction of what the offered requests will grow to (long outputs the
router cannot know), driven over HTTP. Adopts find no room and running requests are
preempted, yet no request gets a 4xx or 5xx and every one streams all its tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

pytestmark = [pytest.mark.slow]

BLOCK_BYTES = 8192  # the tiny model's KV block (16 tokens)
NUM_BLOCKS = 16  # per worker: 256 tokens
NUM_REQUESTS = 8
PROMPT_CHARS = 120  # byte tokenizer: ~120 tokens, 8 blocks
MAX_TOKENS = 64  # peak ~12 blocks each: 8 at once want ~96 blocks of 16
POLICIES = ("round_robin", "least_loaded", "prefix_aware", "slo_goodput")


@pytest.fixture(scope="module")
def small_pools() -> Iterator[ServedGateway]:
    config = tiny_config(
        **{
            "workers.prefill": 1,
            "workers.decode": 1,
            "kvtransfer.backend": "local",
            "kvtransfer.lease_s": 30.0,
            "engine.kv_cache_bytes": NUM_BLOCKS * BLOCK_BYTES,
            "router.max_hold_s": 30.0,
            "router.rebalance_interval_s": 3600.0,
            # Latency targets out of reach of refusal: this is about memory, not admission.
            "router.default_slo.ttft_ms": 600_000.0,
            "router.default_slo.tpot_ms": 600_000.0,
        }
    )
    with ServedGateway(real_service(config, ray=False)) as server:
        yield server


async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, str]:
    """(status, tokens streamed, error text) of one streamed completion."""
    body = {
        "model": "tiny",
        "prompt": f"{i:03d} " + "memory " * (PROMPT_CHARS // 7),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, 0, (await response.aread()).decode()
        tokens, error = 0, ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = json.dumps(event["error"])
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return 200, tokens, error


@pytest.mark.parametrize("policy", POLICIES)
def test_no_request_fails_for_lack_of_decode_memory(
    small_pools: ServedGateway, policy: str
) -> None:
    server = small_pools
    server.svc.executor.use_policy(policy)
    no_room = server.svc.metrics.retries.labels("capacity")
    before = no_room._value.get()

    async def burst() -> list[tuple[int, int, str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS))))

    results = asyncio.run(asyncio.wait_for(burst(), 150.0))
    failed = [r for r in results if r[0] != 200 or r[2]]
    assert not failed, failed
    assert [tokens for _, tokens, _ in results] == [MAX_TOKENS] * NUM_REQUESTS
    if policy != "slo_goodput":  # it admits by the predicted peak, and holds instead
        assert no_room._value.get() > before  # the decode pool was short: adopts refused
