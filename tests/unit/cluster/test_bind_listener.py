"""The gateway's socket, bound by ``baton serve`` before Ray starts (``bind_listener``)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.cluster.serve import bind_listener


def test_connections_accepted_on_it_send_without_delay() -> None:
    """``TCP_NODELAY`` on each accepted connection. asyncio sets it only where the
    listening socket says ``IPPROTO_TCP``; without it a 429 written as its head, then its
    body, waited for the client's delayed ACK (refusals took 52-57 ms in the live
    overload test, against 12-21 ms)."""

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bind_listener("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, client = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, timeout=5)
        finally:
            client.close()
            server.close()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0


def test_bound_but_not_serving_refuses_connections_at_once() -> None:
    """While the workers load, a client is refused, not left waiting in a backlog."""
    listener = bind_listener("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(listener.getsockname(), timeout=5)
    finally:
        listener.close()


def test_a_taken_address_is_an_os_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(OSError, match="in use"):
            bind_listener("127.0.0.1", held.getsockname()[1])
