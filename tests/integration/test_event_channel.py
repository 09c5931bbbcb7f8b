"""A Ray worker's events reach the gateway as one message per engine step, not per token,
over the transport that serves (the socket channel; the Ray channel as its fallback)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from router.types import Role
from services.backends.fake import FakeEngine, FakeTokenizer
from services.engine.messages import EngineRequest, FinishReason, SamplingParams
from services.workers.actor import launch_ray_worker
from services.workers.client import RayWorkerClient, Transport, WorkerDiedError
from services.workers.messages import Generate, TokenDelta
from services.workers.socket_channel import SocketChannel
from services.workers.worker import WorkerSpec

pytestmark = [pytest.mark.ray]

TOK = FakeTokenizer()
NUM_REQUESTS, NUM_TOKENS = 8, 64


def job(request_id: str, max_tokens: int = NUM_TOKENS) -> Generate:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Generate(EngineRequest(request_id, tuple(TOK.encode(request_id)), sampling))


# A step of 5 ms, as a small model's decode step takes: with steps of microseconds the eight
# requests, arriving a few ms apart on a loaded machine, finished one by one without ever
# sharing a step (128 messages in one CI run).
ENGINE = functools.partial(FakeEngine, step_s=0.005)


def launch(name: str, transport: Transport = "socket") -> RayWorkerClient:
    spec = WorkerSpec(name, Role.MIXED, ENGINE, telemetry_interval_s=0.05)
    client = launch_ray_worker(spec, num_cpus=0, num_gpus=0)
    return RayWorkerClient(client.worker_id, client.actor, transport)


async def tokens_of(client: RayWorkerClient, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for event in client.generate(job(request_id)):
        assert isinstance(event, TokenDelta)
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            assert event.finish_reason is FinishReason.LENGTH
    return tokens


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_a_64_token_stream_takes_fewer_messages_than_tokens_with_8_decoding(
    ray_cluster: str, transport: Transport
) -> None:
    client = launch(f"channel-8-{transport}", transport)

    async def run() -> tuple[list[list[int]], int]:
        await client.ping()  # the actor is up: time the streams, not the start
        ids = [f"r{i}" for i in range(NUM_REQUESTS)]
        streams = await asyncio.gather(*(tokens_of(client, i) for i in ids))
        return streams, client.num_messages

    try:
        streams, num_messages = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        client.kill()
    assert client.transport == transport  # the socket served: no silent fallback to Ray
    assert all(len(s) == NUM_TOKENS for s in streams)
    assert len({tuple(s) for s in streams}) > 1  # eight different requests really ran
    # One message per request per token would be 8 * 64 = 512.
    assert 0 < num_messages < NUM_TOKENS + NUM_REQUESTS, num_messages


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_a_worker_killed_mid_stream_fails_every_stream_with_worker_died(
    ray_cluster: str, transport: Transport
) -> None:
    import ray

    client = launch(f"channel-dies-{transport}", transport)

    async def run() -> list[BaseException | list[int]]:
        await client.ping()

        async def one(request_id: str) -> list[int]:
            tokens: list[int] = []
            stream = client.generate(job(request_id, max_tokens=1_000_000))
            async for event in stream:
                assert isinstance(event, TokenDelta)
                tokens.extend(event.token_ids)
                if request_id == "a" and len(tokens) >= 5:
                    ray.kill(client.actor, no_restart=True)
            return tokens

        return await asyncio.gather(one("a"), one("b"), return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 60))
    assert all(isinstance(r, WorkerDiedError) for r in results), results
    if transport == "socket":  # found from the socket's EOF at once, not from Ray or a timeout
        assert all("ConnectionResetError" in str(r) for r in results), results


def test_a_socket_that_cannot_be_reached_falls_back_to_the_ray_channel(
    ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable(*args: object, **kwargs: object) -> SocketChannel:
        raise ConnectionRefusedError("no route to the worker's channel")

    monkeypatch.setattr(SocketChannel, "connect", unreachable)
    client = launch("channel-fallback")

    async def run() -> list[int]:
        await client.ping()
        return await tokens_of(client, "r0")

    try:
        tokens = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        client.kill()
    assert client.transport == "ray"
    assert len(tokens) == NUM_TOKENS


def _engine_that_cannot_load() -> FakeEngine:
    from services.engine.messages import ModelLoadError

    raise ModelLoadError("model '/models/gone' is neither a local folder nor a built-in model")


def test_a_worker_whose_engine_cannot_start_says_why_it_died(ray_cluster: str) -> None:
    spec = WorkerSpec("cannot-load", Role.MIXED, _engine_that_cannot_load)
    launched = launch_ray_worker(spec, num_cpus=0, num_gpus=0)
    client = RayWorkerClient(launched.worker_id, launched.actor, "socket")
    with pytest.raises(WorkerDiedError) as e:
        asyncio.run(asyncio.wait_for(client.ping(), 60))
    # What the operator reads in the controller's log and /ready, not only "ActorDiedError".
    assert str(e.value) == (
        "worker cannot-load died: ActorDiedError in its __init__: ModelLoadError: "
        "model '/models/gone' is neither a local folder nor a built-in model"
    )
