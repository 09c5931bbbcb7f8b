"""Connection limits on a real uvicorn server (FakeEngine workers): a half-sent header is
closed in time, oversized headers get a 431, idle keep-alives close, and a request past
gateway.max_connections gets a 503 in OpenAI's shape."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.support.server import ServedGateway
from tests.unit.gateway.conftest import fake_config, fake_service


@contextmanager
def served(**overrides: Any) -> Iterator[ServedGateway]:
    with ServedGateway(fake_service(fake_config(**overrides))) as server:
        yield server


def _connect(server: ServedGateway) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.settimeout(5)
    return sock


def _closed_after_s(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock``, and what it sent first."""
    started = time.monotonic()
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return time.monotonic() - started, data


def test_a_half_sent_header_is_closed_after_the_header_timeout() -> None:
    with served(**{"gateway.header_timeout_s": 1.0, "gateway.keep_alive_timeout_s": 30}) as server:
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        elapsed_s, _ = _closed_after_s(sock)
        assert 0.8 <= elapsed_s < 3.0
        idle = _connect(server)  # a connection that never sends a byte
        elapsed_s, _ = _closed_after_s(idle)
        assert 0.8 <= elapsed_s < 3.0
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_headers_over_the_limit_get_a_431() -> None:
    with served(**{"gateway.max_header_bytes": 2048}) as server:
        r = httpx.get(f"{server.base_url}/health", headers={"X-Big": "a" * 4096}, timeout=5)
        assert r.status_code == 431
        ok = httpx.get(f"{server.base_url}/health", headers={"X-Small": "a" * 512}, timeout=5)
        assert ok.status_code == 200


def test_an_idle_keep_alive_connection_is_closed() -> None:
    with served(**{"gateway.keep_alive_timeout_s": 0.5}) as server:
        sock = _connect(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        elapsed_s, data = _closed_after_s(sock)
        assert data.startswith(b"HTTP/1.1 200")
        assert elapsed_s < 2.0


def test_a_request_past_max_connections_gets_a_503() -> None:
    with served(**{"gateway.max_connections": 2, "gateway.header_timeout_s": 30}) as server:
        held = [_connect(server) for _ in range(2)]
        time.sleep(0.2)  # the server has accepted both
        r = httpx.get(f"{server.base_url}/v1/models", timeout=5)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert "connections" in json.loads(r.text)["error"]["message"]
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
