"""Workers as Ray actors with the real tiny engine: disaggregated equals colocated, spread,
hang-ups free every block, a dead worker is noticed and its request continues elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from services.engine.messages import SamplingParams
from services.workers.messages import TokenDelta
from tests.support.cluster import real_service, tiny_config, worker_snapshots
from tests.support.server import ServedGateway

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [
    (f"request {i}: " + "lorem ipsum dolor " * ((i * 7) % 13), 8 + (i * 5) % 33) for i in range(16)
]


@pytest.fixture(scope="module")
def colocated() -> Iterator[ServedGateway]:
    config = tiny_config(**{"workers.mode": "colocated", "workers.prefill": 1, "workers.decode": 0})
    with ServedGateway(real_service(config, ray=False)) as server:
        yield server


@pytest.fixture(scope="module")
def nixl_2p2d(ray_cluster: str) -> Iterator[ServedGateway]:
    config = tiny_config(
        **{"workers.prefill": 2, "workers.decode": 2, "kvtransfer.backend": "nixl"}
    )
    with ServedGateway(real_service(config, ray=True, replace_dead=True)) as server:
        yield server


@pytest.fixture(scope="module")
def torch_1p1d(ray_cluster: str) -> Iterator[ServedGateway]:
    config = tiny_config(**{"kvtransfer.backend": "torch"})
    with ServedGateway(real_service(config, ray=True)) as server:
        yield server


async def _complete_all(base_url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(prompt: str, max_tokens: int) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text: str = r.json()["choices"][0]["text"]
            return text

        return await asyncio.gather(*(one(p, n) for p, n in PROMPTS))


@pytest.mark.parametrize("backend", ["nixl", "torch"])
def test_disaggregated_text_equals_colocated(
    backend: str, colocated: ServedGateway, request: pytest.FixtureRequest
) -> None:
    disagg: ServedGateway = request.getfixturevalue(
        "nixl_2p2d" if backend == "nixl" else "torch_1p1d"
    )
    expected = asyncio.run(_complete_all(colocated.base_url))
    got = asyncio.run(_complete_all(disagg.base_url))
    assert got == expected
    assert len(set(expected)) > 8  # the prompts really produce different texts
    moved = disagg.svc.metrics.transfer_bytes.labels(backend)._value.get()
    assert moved > 0


def test_requests_spread_across_all_four_workers(nixl_2p2d: ServedGateway) -> None:
    asyncio.run(_complete_all(nixl_2p2d.base_url))
    finished = {w: s.num_finished_requests for w, s in worker_snapshots(nixl_2p2d).items()}
    assert set(finished) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(n >= 4 for n in finished.values()), finished


async def _hang_up_after(base_url: str, num_chunks: int) -> None:
    body = {
        "model": "tiny",
        "prompt": "a long story " * 20,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= num_chunks:
                    break  # leaving the block closes the connection mid-stream


def test_hang_up_mid_stream_frees_every_block(nixl_2p2d: ServedGateway) -> None:
    asyncio.run(asyncio.wait_for(_hang_up_after(nixl_2p2d.base_url, 5), 60))
    time.sleep(0.5)
    busy = {w: len(s.running) for w, s in worker_snapshots(nixl_2p2d).items() if s.running}
    assert not busy, f"aborted request still running: {busy}"
    time.sleep(2.5)  # past the 2 s lease: nothing may stay held
    for worker_id, s in worker_snapshots(nixl_2p2d).items():
        assert s.num_held_blocks == 0, worker_id
        assert s.num_used_blocks == 0, (worker_id, s.num_used_blocks)
        assert s.num_pending_pulls == 0 and not s.waiting_prompt_lens


def test_dead_decode_worker_is_replaced_and_the_stream_continues(
    nixl_2p2d: ServedGateway, colocated: ServedGateway
) -> None:
    """Kill the decode worker mid-stream: the client still gets the colocated text."""
    import ray

    prompt = tuple(colocated.svc.tokenizer.encode("the relay baton passes "))
    sampling = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)

    async def run(server: ServedGateway, kill_after: int | None) -> tuple[list[int], set[str]]:
        tokens: list[int] = []
        workers: set[str] = set()
        killed = False
        async for delta in server.svc.generate("death-test", prompt, sampling, time.monotonic()):
            assert isinstance(delta, TokenDelta)
            tokens.extend(delta.token_ids)
            workers.add(delta.worker_id)
            if kill_after is not None and not killed and len(tokens) >= kill_after:
                victim = delta.worker_id
                if victim.startswith("decode"):
                    client = server.svc.controller.client(victim)
                    ray.kill(client.actor, no_restart=True)  # type: ignore[union-attr]
                    killed = True
        return tokens, workers

    expected, _ = colocated.call(run(colocated, None))
    got, workers = nixl_2p2d.call(run(nixl_2p2d, 10), timeout_s=120)
    assert got == expected
    decoders = {w for w in workers if w.startswith("decode")}
    assert len(decoders) == 2, workers  # the stream moved off the dead one
    retries = nixl_2p2d.svc.metrics.retries.labels("worker_died")._value.get()
    assert retries >= 1
    deadline = time.monotonic() + 60
    while not any(".r1" in w for w in nixl_2p2d.svc.controller.workers()):
        assert time.monotonic() < deadline, "dead worker was not replaced"
        time.sleep(0.2)
    assert len(nixl_2p2d.svc.controller.workers()) == 4


def test_an_idle_dead_worker_is_noticed_within_a_second(nixl_2p2d: ServedGateway) -> None:
    import ray

    deadline = time.monotonic() + 60
    while not nixl_2p2d.svc.controller.is_ready():  # a replacement may still be starting
        assert time.monotonic() < deadline
        time.sleep(0.1)
    victim = "prefill-1"
    client = nixl_2p2d.svc.controller.client(victim)
    assert client is not None
    killed_s = time.monotonic()
    ray.kill(client.actor, no_restart=True)  # type: ignore[attr-defined]
    while victim in nixl_2p2d.svc.controller.workers():
        assert time.monotonic() - killed_s < 1.0, "death not noticed within a second"
        time.sleep(0.01)
    assert not nixl_2p2d.svc.router.is_alive(victim)  # the router no longer sees it
