"""The HTTP server's connection limits: what a client can hold open, and for how long.

    header_timeout_s        a connection's next request line and headers must arrive
                            within this, from its opening or from the end of the
                            previous response; else it is closed (slowloris)
    body_timeout_s          a request's body must arrive within this from the end of
                            its headers; else a 408 in OpenAI's error shape, closed (a
                            body that stops arriving held its connection for good)
    max_header_bytes        request line + headers; more: 431, closed
    keep_alive_timeout_s    an idle kept-alive connection is closed
    max_connections         a request that arrives while more connections are open
                            gets a 503 in OpenAI's error shape (and the connection closes)

``uvicorn_config(app, gateway)`` is how ``baton serve`` (and the tests' real server)
builds uvicorn's config, so these limits are on wherever the gateway listens. A client
that stops reading a stream is the response's business: ``services.gateway.streaming``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.config import GatewayConfig
from services.gateway.errors import BodyTimeout, NotReady

__all__ = ["ConnectionLimits", "guarded_protocol", "uvicorn_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits one server's connections share (a class attribute of its protocol)."""

    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    body_timeout_s: float = 30.0

    @classmethod
    def of(cls, gateway: GatewayConfig) -> ConnectionLimits:
        return cls(
            gateway.header_timeout_s,
            gateway.max_header_bytes,
            gateway.max_connections,
            gateway.body_timeout_s,
        )


def uvicorn_config(app: ASGIApp, gateway: GatewayConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for the gateway app with ``gateway``'s connection limits."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(ConnectionLimits.of(gateway)),
        timeout_keep_alive=gateway.keep_alive_timeout_s,  # type: ignore[arg-type]  # float works
        **kwargs,
    )


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    class GuardedHttpToolsProtocol(_GuardedHttpToolsProtocol):
        _limits = limits

    return GuardedHttpToolsProtocol


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a body deadline, a header
    size cap and a connection cap (uvicorn's own ``limit_concurrency`` answers plain text
    and counts tasks, not connections)."""

    _limits: ConnectionLimits
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _headers_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self._disarm_body_timer()
        self._body_timer = self.loop.call_later(self._limits.body_timeout_s, self._on_body_timeout)
        if len(self.connections) <= self._limits.max_connections:
            super().on_headers_complete()
            return
        log.warning("%d connections open, over gateway.max_connections", len(self.connections))
        app, self.app = self.app, _too_many_connections  # this one request, then close
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._disarm_body_timer()  # the body is in
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a queued request starts now: its headers are in
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_header_timer()  # the next request's headers are due in time too

    def send_400_response(self, msg: str) -> None:
        if not self._headers_too_large:
            super().send_400_response(msg)
            return
        body = f"request headers are larger than {self._limits.max_header_bytes} bytes".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._limits.max_header_bytes:
            self._headers_too_large = True
            raise _HeadersTooLarge  # httptools turns it into a parser error: send_400_response

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(
            self._limits.header_timeout_s, self._on_header_timeout
        )

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_body_timeout(self) -> None:
        """The body stopped arriving: a 408 if nothing was answered yet, and the
        connection closes (the request's app sees the client gone)."""
        self._body_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            seconds = self._limits.body_timeout_s
            error = BodyTimeout(f"the request body did not arrive within {seconds:g} s")
            body = json.dumps(error.body()).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: "
                + str(len(body)).encode()
                + b"\r\nconnection: close\r\n\r\n"
                + body
            )
        self.transport.close()


class _HeadersTooLarge(Exception):
    pass


async def _too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    error = NotReady("too many open connections; retry shortly", 1.0)
    body = json.dumps(error.body()).encode()
    headers = [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send(
        {
            "type": "http.response.start",
            "status": error.status_code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
