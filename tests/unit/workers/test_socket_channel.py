"""The socket channel between a gateway and a worker: the secret first, one message per
engine step, and a hang-up on either side ends the other side's requests at once."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import AsyncIterator

import pytest

from router.types import Role
from services.backends.fake import FakeEngine, FakeTokenizer
from services.engine.messages import EngineRequest, FinishReason, RequestOutput, SamplingParams
from services.workers.channel import ChannelClosed
from services.workers.messages import Generate, TokenDelta, WorkerEvent, WorkerSnapshot
from services.workers.socket_channel import (
    ACCEPTED,
    SECRET_BYTES,
    ChannelAddress,
    ChannelRefusedError,
    ChannelServer,
    SocketChannel,
)
from services.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.asyncio

TOK = FakeTokenizer()
NUM_REQUESTS, NUM_TOKENS = 8, 64
NUM_BLOCKS = 1024
UNPICKLED: list[str] = []  # what a hostile pickle managed to run, if it was ever loaded


class PacedFakeEngine(FakeEngine):
    """A fake engine whose steps take a millisecond, so that a long request is still
    running when the test acts on it (tests only)."""

    def __init__(self) -> None:
        super().__init__(num_blocks=NUM_BLOCKS, max_model_len=1 << 20)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        return super().step()


def _record_unpickled(tag: str) -> None:
    UNPICKLED.append(tag)


class Hostile:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return _record_unpickled, ("hostile",)


def job(request_id: str, max_tokens: int = NUM_TOKENS) -> Generate:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt = tuple(TOK.encode(f"prompt of {request_id}"))
    return Generate(EngineRequest(request_id, prompt, sampling))


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    spec = WorkerSpec("w", Role.MIXED, PacedFakeEngine, telemetry_interval_s=0.05)
    worker = Worker(spec)
    try:
        yield worker
    finally:
        await worker.shutdown()


async def tokens_until_final(queue: asyncio.Queue[WorkerEvent | ChannelClosed]) -> list[int]:
    tokens: list[int] = []
    while True:
        event = await queue.get()
        assert isinstance(event, TokenDelta), event
        tokens.extend(event.token_ids)
        if event.finish_reason is not None:
            assert event.finish_reason is FinishReason.LENGTH
            return tokens


async def eventually(worker: Worker, done: object, timeout_s: float = 10.0) -> WorkerSnapshot:
    """The first snapshot for which ``done(snapshot)`` holds (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snapshot = await worker.snapshot()
        if done(snapshot) or time.monotonic() > deadline:  # type: ignore[operator]
            return snapshot
        await asyncio.sleep(0.01)


async def test_eight_decoding_requests_share_one_message_per_step(worker: Worker) -> None:
    address = await worker.channel_address()
    channel = await SocketChannel.connect(address, "gw")
    try:
        queues = [channel.demux.register(f"r{i}") for i in range(NUM_REQUESTS)]
        for i in range(NUM_REQUESTS):
            channel.submit(job(f"r{i}"))
        streams = await asyncio.wait_for(
            asyncio.gather(*(tokens_until_final(q) for q in queues)), 20
        )
    finally:
        channel.close()
    assert all(len(tokens) == NUM_TOKENS for tokens in streams)
    assert len({tuple(tokens) for tokens in streams}) > 1  # eight different requests ran
    # A message per request per token would be 8 * 64 = 512; one per engine step is ~64.
    assert 0 < channel.demux.num_batches < NUM_TOKENS + NUM_REQUESTS, channel.demux.num_batches


async def test_a_wrong_secret_is_refused_and_the_connection_closed(worker: Worker) -> None:
    address = await worker.channel_address()
    wrong = ChannelAddress(address.host, address.port, bytes(SECRET_BYTES))
    with pytest.raises(ChannelRefusedError):
        await SocketChannel.connect(wrong, "gw")

    # A peer that skips the secret and sends a frame: nothing it sends is unpickled, and
    # the worker closes the connection without an answer.
    reader, writer = await asyncio.open_connection(address.host, address.port)
    payload = pickle.dumps(Hostile())
    writer.write(len(payload).to_bytes(4, "big") + payload + bytes(SECRET_BYTES))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # EOF: closed, nothing answered
    writer.close()
    assert UNPICKLED == []

    # The right secret is accepted (the refusals above are not a server that answers no one).
    reader, writer = await asyncio.open_connection(address.host, address.port)
    writer.write(address.secret)
    assert await asyncio.wait_for(reader.read(1), 5) == ACCEPTED
    writer.close()


async def test_a_peer_that_never_proves_the_secret_is_closed(worker: Worker) -> None:
    server = ChannelServer(worker, "127.0.0.1", handshake_timeout_s=0.2)
    address = await server.start()
    try:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(address.secret[:5])  # a start, then silence
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        server.close()


async def test_a_dropped_gateway_connection_aborts_its_requests_and_frees_blocks(
    worker: Worker,
) -> None:
    assert (await worker.snapshot()).num_free_blocks == NUM_BLOCKS
    channel = await SocketChannel.connect(await worker.channel_address(), "gw")
    queue = channel.demux.register("long")
    channel.submit(job("long", max_tokens=1_000_000))  # minutes of steps: only an abort ends it
    while True:  # tokens flow and blocks are taken
        event = await asyncio.wait_for(queue.get(), 5)
        assert isinstance(event, TokenDelta)
        if event.num_output_tokens > 64:
            break
    busy = await worker.snapshot()
    assert busy.running and busy.num_free_blocks < NUM_BLOCKS
    channel.close()  # the gateway hangs up without a word

    idle = await eventually(worker, lambda s: not s.running and s.num_free_blocks == NUM_BLOCKS)
    assert not idle.running, "the dropped gateway's request still runs"
    assert idle.num_free_blocks == NUM_BLOCKS, "its blocks were not freed"
    assert idle.num_finished_requests == 0  # aborted, not run to its end


async def test_an_abort_sent_over_the_socket_stops_only_that_request(worker: Worker) -> None:
    channel = await SocketChannel.connect(await worker.channel_address(), "gw")
    try:
        stopped, kept = channel.demux.register("stopped"), channel.demux.register("kept")
        channel.submit(job("stopped", max_tokens=1_000_000))
        channel.submit(job("kept", max_tokens=1_000_000))
        assert isinstance(await asyncio.wait_for(stopped.get(), 5), TokenDelta)
        assert len((await worker.snapshot()).running) == 2
        channel.abort("stopped")
        snapshot = await eventually(worker, lambda s: len(s.running) == 1)
        assert len(snapshot.running) == 1
        while not kept.empty():
            kept.get_nowait()
        assert isinstance(await asyncio.wait_for(kept.get(), 5), TokenDelta)  # still streams
        while not stopped.empty():  # what was sent before the abort landed, then nothing
            assert isinstance(stopped.get_nowait(), TokenDelta)
        await asyncio.wait_for(kept.get(), 5)
        assert stopped.empty()
    finally:
        channel.close()


async def test_a_worker_that_goes_away_closes_every_stream_at_once(worker: Worker) -> None:
    channel = await SocketChannel.connect(await worker.channel_address(), "gw")
    queues = [channel.demux.register(name) for name in ("a", "b")]
    for name in ("a", "b"):
        channel.submit(job(name, max_tokens=1_000_000))
    assert isinstance(await asyncio.wait_for(queues[0].get(), 5), TokenDelta)
    worker.stop_now()  # its sockets close, as a killed process's do
    for queue in queues:
        while not isinstance(event := await asyncio.wait_for(queue.get(), 5), ChannelClosed):
            assert isinstance(event, TokenDelta)
        assert "ConnectionResetError" in event.cause  # the socket's EOF, not a timeout
    assert channel.closed
