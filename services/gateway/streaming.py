"""An SSE response that a client cannot hold open by not reading.

A client that stops reading fills the socket's buffers; uvicorn then pauses every
``send`` until they drain, so the stream, its request and the request's KV blocks
would stay until the client left. ``BoundedStreamingResponse`` gives each send
``write_timeout_s``: past it the response ends (uvicorn closes the connection) and
the body iterator is closed at once, which aborts the request on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

__all__ = ["BoundedStreamingResponse"]

log = logging.getLogger(__name__)


class BoundedStreamingResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        write_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, headers=headers, media_type=media_type)
        self._content = content
        self._write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._write_timeout_s)
            except TimeoutError:
                log.warning(
                    "a stream's client read nothing for %.0f s; closing it", self._write_timeout_s
                )
                raise

        try:
            await super().stream_response(bounded_send)
        except TimeoutError:
            return  # uvicorn closes a connection whose response did not complete
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                # Now, not when the generator is collected; shielded, because a hang-up
                # cancels this task's scope at every await.
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await aclose()
