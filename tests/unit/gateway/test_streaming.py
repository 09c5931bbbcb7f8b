"""A stream whose client stops reading is cut after write_timeout_s and its body closed
(which is what aborts the request on the workers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gateway.streaming import BoundedStreamingResponse

pytestmark = pytest.mark.asyncio


async def test_a_client_that_stops_reading_is_cut_and_the_body_closed() -> None:
    closed = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    async def send(message: Any) -> None:
        sent.append(message)
        if len(sent) > 3:  # the client's buffers are full: writes block from here on
            await asyncio.sleep(3600)

    async def receive() -> Any:
        await asyncio.sleep(3600)

    response = BoundedStreamingResponse(body(), write_timeout_s=0.3, media_type="text/plain")
    started = time.monotonic()
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await asyncio.wait_for(response(scope, receive, send), 5)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert closed.is_set()  # closed now, not when collected
    assert not any(m.get("more_body") is False for m in sent)  # the response never completed


async def test_a_reading_client_gets_the_whole_stream() -> None:
    async def body() -> AsyncIterator[bytes]:
        for i in range(5):
            await asyncio.sleep(0.1)  # slower than the write timeout between items: fine
            yield str(i).encode()

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        await asyncio.sleep(3600)

    response = BoundedStreamingResponse(body(), write_timeout_s=0.05)
    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    assert b"".join(m.get("body", b"") for m in sent) == b"01234"
    assert sent[-1]["more_body"] is False
