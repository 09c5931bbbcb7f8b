"""The event channel over a direct TCP socket: the hot path between a gateway and a worker.

A Ray actor call or streamed item costs about a millisecond of CPU on each side; a
framed message on a socket costs tens of microseconds. So submit, abort and the event
batches travel over one TCP connection per (gateway, worker), and Ray keeps lifecycle
and control (launch, snapshot, set_role, telemetry, shutdown, kill) and finding the
socket. Both ends live here::

    gateway: SocketChannel                      worker: ChannelServer (the worker's loop)
    address = await actor.channel_address.remote()   ChannelAddress(host, port, secret)
    connect(host, port)             ──────▶     accept
    secret (SECRET_BYTES raw)       ──────▶     compared; wrong, short or late: closed
                                    ◀──────     ACCEPTED (one byte)
    Submit(job) | Abort(request_id) ──────▶     worker.submit_soon | worker.abort_soon
                                    ◀──────     EventBatch, one per engine step

After the handshake every message is a frame: a 4-byte big-endian length, then a
pickle. Nothing is unpickled before the secret is proven; past it, a peer is trusted
with pickle as Ray already trusts every member of the cluster.

Failure, exactly as on the Ray channel (``services/workers/channel.py``):

* The gateway goes away (its process dies, it hangs up): the worker reads EOF and
  aborts every request of that connection still running, freeing their blocks.
* The worker dies: the gateway reads EOF at once, and every registered request gets
  ``ChannelClosed`` (the client raises ``WorkerDiedError``).
* Backpressure: the worker writes a step's batch at once while nothing waits in the
  socket's buffer (``Outbox.send_now``); otherwise its sender task waits for the
  buffer to drain, and meanwhile the outbox gathers the steps' events into one batch
  (nothing lost, one message). A gateway that reads nothing for ``send_stall_s``
  counts as gone.
* Nothing waits forever: the connect, the handshake (both sides) and a stalled send
  each have a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import pickle
import secrets
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from services.workers.channel import EventDemux, Outbox
from services.workers.messages import EventBatch, Job

__all__ = [
    "Abort",
    "ChannelAddress",
    "ChannelHost",
    "ChannelRefusedError",
    "ChannelServer",
    "SocketChannel",
    "Submit",
    "node_ip_address",
]

log = logging.getLogger(__name__)

SECRET_BYTES = 32
ACCEPTED = b"\x01"
_HEADER = struct.Struct("!I")


class ChannelRefusedError(ConnectionError):
    """The worker closed the connection during the handshake (a wrong secret)."""


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """Where a worker's channel listens, and the secret that opens it (one per worker)."""

    host: str
    port: int
    secret: bytes


@dataclass(frozen=True, slots=True)
class Submit:
    job: Job


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


class ChannelHost(Protocol):
    """What the server needs of the worker (``Worker`` implements it)."""

    def open_outbox(self, subscriber: str) -> Outbox: ...

    def close_outbox(self, subscriber: str) -> None:
        """The subscriber is gone: abort its running requests."""
        ...

    def submit_soon(self, subscriber: str, job: Job) -> None: ...

    def abort_soon(self, request_id: str) -> None: ...


def node_ip_address() -> str:
    """This node's address as the Ray cluster knows it (loopback outside Ray)."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    if not ray.is_initialized():
        return "127.0.0.1"
    address: str = ray.util.get_node_ip_address()
    return address


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message; ``IncompleteReadError`` at EOF."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    # A peer whose node vanished sends no FIN; keepalive ends the connection eventually.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


# -- the worker's end -----------------------------------------------------------------------


class ChannelServer:
    """Listens on the worker's event loop; one subscriber (an outbox) per connection."""

    def __init__(
        self,
        host: ChannelHost,
        address: str,
        *,
        handshake_timeout_s: float = 5.0,
        send_stall_s: float = 30.0,
    ) -> None:
        self._host = host
        self._address = address
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._handshake_timeout_s = handshake_timeout_s
        self._send_stall_s = send_stall_s
        self._server: asyncio.Server | None = None
        self._ids = itertools.count()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> ChannelAddress:
        """Listen (port 0: any free port) once; the address to hand out."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self._address, 0)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(self._address, port, self._secret)

    def close(self) -> None:
        """Stop listening and drop every connection (their requests are aborted)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if await self._handshake(reader, writer):
                await self._run(f"sock-{next(self._ids)}", reader, writer)
        except asyncio.CancelledError:
            # The worker's loop is ending. Returning (not raising) keeps asyncio's stream
            # callback from logging the cancellation as an error; _run has cleaned up.
            return
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            secret = await asyncio.wait_for(
                reader.readexactly(SECRET_BYTES), self._handshake_timeout_s
            )
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as e:
            log.warning("event channel: no handshake from %s (%s)", _peer(writer), type(e).__name__)
            return False
        if not hmac.compare_digest(secret, self._secret):
            log.warning("event channel: wrong secret from %s; closed", _peer(writer))
            return False
        _keep_alive(writer)
        writer.write(ACCEPTED)
        return True

    async def _run(
        self, subscriber: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        outbox = self._host.open_outbox(subscriber)
        outbox.send_now = functools.partial(_send_now, writer)
        receiving = asyncio.create_task(self._receive(subscriber, reader))
        sending = asyncio.create_task(self._send(outbox, writer))
        try:
            done, _ = await asyncio.wait({receiving, sending}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.info("event channel %s ended: %r", subscriber, task.exception())
        finally:
            receiving.cancel()
            sending.cancel()
            self._host.close_outbox(subscriber)

    async def _receive(self, subscriber: str, reader: asyncio.StreamReader) -> None:
        host = self._host
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                match await _read_frame(reader):
                    case Submit(job=job):
                        host.submit_soon(subscriber, job)
                    case Abort(request_id=request_id):
                        host.abort_soon(request_id)
                    case other:
                        raise TypeError(f"unexpected message {type(other).__name__}")

    async def _send(self, outbox: Outbox, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        while True:
            writer.write(_frame(await outbox.next_batch()))
            if transport.get_write_buffer_size():  # the kernel's buffer is full: wait
                await asyncio.wait_for(writer.drain(), self._send_stall_s)


def _send_now(writer: asyncio.StreamWriter, batch: EventBatch) -> bool:
    """Write ``batch`` if nothing is waiting to go out before it (else the sender task will)."""
    if writer.transport.get_write_buffer_size() or writer.is_closing():
        return False
    writer.write(_frame(batch))
    return True


def _peer(writer: asyncio.StreamWriter) -> str:
    return str(writer.get_extra_info("peername"))


# -- the gateway's end ----------------------------------------------------------------------


class SocketChannel:
    """One connection to one worker: jobs and aborts out, batches in (split by ``demux``)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, subscriber: str
    ) -> None:
        self._writer = writer
        self.demux = EventDemux(self._batches(reader), subscriber)

    @classmethod
    async def connect(
        cls, address: ChannelAddress, subscriber: str, timeout_s: float = 5.0
    ) -> SocketChannel:
        """Connect and prove the secret; ``ChannelRefusedError`` if the worker says no,
        ``TimeoutError`` or ``OSError`` if it cannot be reached in ``timeout_s``."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), timeout_s
        )
        try:
            writer.write(address.secret)
            reply = await asyncio.wait_for(reader.read(len(ACCEPTED)), timeout_s)
        except BaseException:
            writer.transport.abort()
            raise
        if reply != ACCEPTED:
            writer.transport.abort()
            raise ChannelRefusedError(f"the worker at {address.host}:{address.port} refused")
        _keep_alive(writer)
        return cls(reader, writer, subscriber)

    @property
    def closed(self) -> bool:
        return self.demux.closed or self._writer.is_closing()

    def submit(self, job: Job) -> None:
        self._writer.write(_frame(Submit(job)))

    def abort(self, request_id: str) -> None:
        """Fire and forget (a closed channel's requests were aborted by the worker)."""
        if not self._writer.is_closing():
            self._writer.write(_frame(Abort(request_id)))

    def close(self) -> None:
        self.demux.close()
        self._writer.transport.abort()

    async def _batches(self, reader: asyncio.StreamReader) -> AsyncIterator[EventBatch]:
        try:
            while True:
                try:
                    batch = await _read_frame(reader)
                except asyncio.IncompleteReadError:
                    raise ConnectionResetError("the worker closed the event channel") from None
                yield batch
        finally:
            self._writer.transport.abort()
