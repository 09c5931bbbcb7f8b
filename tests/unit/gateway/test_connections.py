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

from services.cluster.factories import FakeEngineFactory
from tests.support.server import ServedGateway
from tests.unit.gateway.conftest import MODEL, fake_config, fake_service


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


def test_a_stream_whose_client_stops_reading_is_cut_and_its_request_aborted() -> None:
    config = fake_config(
        **{"gateway.stream_write_timeout_s": 1.0, "workers.mode": "colocated", "workers.prefill": 1}
    )
    # Blocks for every token it may make: an engine that ran out would stall the stream
    # with its output already buffered, and no write would ever block (or time out).
    engine = FakeEngineFactory(num_blocks=500_000 // 16 + 8, max_model_len=10**6)
    gateway = ServedGateway(fake_service(config, engine_factory=engine))
    # Small, fixed socket buffers on both sides (accepted sockets inherit the listening
    # socket's), so an unread stream blocks the server's writes after kilobytes, not MBs.
    gateway._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with gateway as server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps(
            {
                "model": "fake-model",
                "prompt": "hello",
                "max_tokens": 500_000,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        deadline = time.monotonic() + 30  # the client reads nothing from here on
        running = True
        while running and time.monotonic() < deadline:
            time.sleep(0.2)
            snapshots = server.svc.router.reports().values()
            running = any(s.running or s.num_used_blocks for s in snapshots)
        assert not running, "the unread stream's request still runs"
        sock.settimeout(10)
        elapsed_s, _ = _closed_after_s(sock)  # drains what was buffered, then EOF
        assert elapsed_s < 10


def test_a_body_that_stops_arriving_gets_a_408_after_the_body_timeout() -> None:
    with served(**{"gateway.body_timeout_s": 1.0, "gateway.header_timeout_s": 30}) as server:
        sock = _connect(server)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model":"tiny"'
        )
        elapsed_s, data = _closed_after_s(sock)
        assert 0.8 <= elapsed_s < 3.0
        assert data.startswith(b"HTTP/1.1 408")
        error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["type"] == "RequestTimeoutError" and "1 s" in error["message"]
        # A body that arrives in time, slowly, is served.
        sock = _connect(server)
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        for i in range(0, len(body), 8):
            sock.sendall(body[i : i + 8])
            time.sleep(0.05)
        _, data = _closed_after_s(sock)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
