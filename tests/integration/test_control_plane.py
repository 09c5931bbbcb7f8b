"""The control plane outlives its gateways: the controller and the workers are named, detached
Ray actors; a `baton gateway` process restarts without restarting a worker, and killing one
gateway under load leaves another serving the right texts, with no block left held;
`baton cluster up` over a running plane of another size names what differs and changes
nothing; a gateway serves on through `cluster down` and `up` without a restart."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadgen.server_proc import ROOT, child_env
from services.cluster.control_plane import (
    NAMESPACE,
    Registry,
    find_control_plane,
    start_control_plane,
)
from services.cluster.serve import build_gateway
from services.config import ClusterConfig
from tests.support.cluster import tiny_config, worker_snapshots
from tests.support.gateway_proc import GatewayProcess
from tests.support.server import ServedGateway

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [(f"request {i}: " + "lorem ipsum dolor " * (i % 5), 12 + 3 * i) for i in range(8)]
LEASE_S = 2.0


@pytest.fixture(scope="module")
def plane(ray_cluster: str) -> Iterator[tuple[Any, ClusterConfig]]:
    import ray

    config = tiny_config(
        **{"workers.prefill": 1, "workers.decode": 1, "kvtransfer.backend": "nixl"}
    )
    handle = start_control_plane(config)
    ray.get(handle.start.remote(), timeout=300)
    try:
        yield handle, config
    finally:
        _down()  # the plane running now (the last test starts one anew)


def _down() -> None:
    """``baton cluster down``: the workers, then the controller."""
    import ray

    handle = find_control_plane()
    if handle is not None:
        ray.get(handle.shutdown.remote(), timeout=60)
        ray.kill(handle, no_restart=True)


def _actor_ids(handle: Any) -> dict[str, str]:
    import ray

    registry: Registry = ray.get(handle.registry.remote())
    return {
        w.worker_id: ray.get_actor(w.actor_name, namespace=NAMESPACE)._actor_id.hex()
        for w in registry.workers
    }


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


async def _complete_all(base_url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return list(await asyncio.gather(*(_complete(client, p, n) for p, n in PROMPTS)))


def test_a_restarted_gateway_serves_again_with_the_same_workers(
    plane: tuple[Any, ClusterConfig], ray_cluster: str
) -> None:
    handle, _ = plane
    before = _actor_ids(handle)
    assert set(before) == {"prefill-0", "decode-0"}
    with GatewayProcess(ray_cluster) as first:
        expected = asyncio.run(_complete_all(first.base_url))
        assert first.stop() == 0
    with GatewayProcess(ray_cluster) as second:
        assert asyncio.run(_complete_all(second.base_url)) == expected
    assert _actor_ids(handle) == before  # same worker ids, same Ray actors


async def _open_streams(base_url: str, started: asyncio.Event, num: int) -> list[str]:
    """``num`` long streams; ``started`` once each has sent a few chunks; each stream's end."""
    body = {
        "model": "tiny",
        "prompt": "a long story " * 20,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    counts = [0] * num

    async def one(i: int, client: httpx.AsyncClient) -> str:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        counts[i] += 1
                        if all(c >= 3 for c in counts):
                            started.set()
                    if line == "data: [DONE]":
                        return "done"
            return "ended"
        except httpx.TransportError as e:
            return type(e).__name__

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(num))))


def test_killing_one_gateway_under_load_leaves_the_other_serving_and_frees_its_blocks(
    plane: tuple[Any, ClusterConfig], ray_cluster: str
) -> None:
    _, config = plane
    with ServedGateway(build_gateway(config)) as survivor, GatewayProcess(ray_cluster) as doomed:
        expected = asyncio.run(_complete_all(survivor.base_url))  # undisturbed

        async def scenario() -> tuple[list[str], list[list[str]]]:
            started = asyncio.Event()
            streams = asyncio.create_task(_open_streams(doomed.base_url, started, 4))
            await asyncio.wait_for(started.wait(), 120)
            load = [asyncio.create_task(_complete_all(survivor.base_url)) for _ in range(2)]
            await asyncio.sleep(0.2)
            await asyncio.to_thread(doomed.kill)  # mid-stream, while the survivor is busy
            return await streams, list(await asyncio.gather(*load))

        ends, texts = asyncio.run(asyncio.wait_for(scenario(), 240))
        assert all(end != "done" for end in ends), ends  # the killed gateway's streams broke
        assert texts == [expected, expected]  # every request to the survivor, right text
        assert asyncio.run(_complete_all(survivor.base_url)) == expected
        time.sleep(LEASE_S + 1.5)  # within the lease, and the workers' notice of the dead
        for worker_id, s in worker_snapshots(survivor).items():
            assert not s.running and not s.waiting_prompt_lens, worker_id
            assert s.num_held_blocks == 0, worker_id
            assert s.num_used_blocks == 0, (worker_id, s.num_used_blocks)


def test_cluster_up_over_a_running_plane_names_what_differs(
    plane: tuple[Any, ClusterConfig], ray_cluster: str
) -> None:
    """``baton cluster up`` asking for another size than the plane running: exit 1 with
    the keys that differ, the plane untouched (it had said 'up' and kept the old size)."""
    handle, _ = plane
    before = _actor_ids(handle)
    up = [sys.executable, "-m", "services.cli", "cluster", "up", "--ray-address", ray_cluster]
    done = subprocess.run(
        [*up, "--model", "tiny", "--prefill", "2", "--decode", "1"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "already running with another configuration" in done.stderr
    assert "workers.prefill: 1, 2" in done.stderr
    assert "Run `baton cluster down` first" in done.stderr
    assert _actor_ids(handle) == before


def test_a_gateway_serves_on_through_cluster_down_and_up(
    plane: tuple[Any, ClusterConfig], ray_cluster: str
) -> None:
    """``baton cluster down`` then ``up`` under a running gateway: the new plane's workers
    reuse the old ids, and the gateway adopts them without a restart (it had kept
    refusing with 503 until restarted). Last in this module: it replaces the plane."""
    import ray

    handle, config = plane
    with GatewayProcess(ray_cluster) as gateway:
        expected = asyncio.run(_complete_all(gateway.base_url))
        _down()
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            deadline = time.monotonic() + 30
            while client.get("/health").status_code != 503:  # its watches saw them die
                assert time.monotonic() < deadline, "the gateway never saw its workers go"
                time.sleep(0.1)
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            assert "no worker is up" in r.json()["error"]["message"]
            anew = start_control_plane(config)
            registry: Registry = ray.get(anew.start.remote(), timeout=300)
            assert {w.worker_id for w in registry.workers} == {"prefill-0", "decode-0"}
            deadline = time.monotonic() + 60
            while client.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the gateway never adopted the new plane"
                time.sleep(0.25)
        assert asyncio.run(_complete_all(gateway.base_url)) == expected
    assert anew != handle  # another controller actor, not Ray's restart of the old one
