"""Length-prefixed JSON messages over a socket, and a c10d Store carried by them.

The torch backend rendezvouses each pull's two-rank process group over the
holder's control connection instead of a ``TCPStore`` (which listens on every
interface): the holder keeps a ``DictStore`` per pull, and the puller's
``SocketStore`` forwards ``set``/``get`` to it over the pull's own socket.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["DictStore", "SocketStore", "recv_msg", "send_msg", "serve_store_ops"]

_HEADER = struct.Struct("!I")
_MAX_MSG_BYTES = 1 << 20


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > _MAX_MSG_BYTES:
        raise ConnectionError(f"control message of {size} bytes is too large")
    msg = json.loads(_recv_exact(sock, size))
    if not isinstance(msg, dict):
        raise ConnectionError("control message is not an object")
    return msg


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the control connection")
        buf += chunk
    return bytes(buf)


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class DictStore(dist.Store):
    """In-memory store for one pull's rendezvous (holder side)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s
        self._values: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cv:
            self._values[key] = _as_bytes(value)
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._values, self._timeout_s):
                raise TimeoutError(f"rendezvous key {key!r} never arrived")
            return self._values[key]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._values for k in keys)


class SocketStore(dist.Store):
    """Puller side: forwards ``set``/``get`` to the holder's DictStore."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self._sock = sock

    def set(self, key: str, value: str | bytes) -> None:
        value_b64 = base64.b64encode(_as_bytes(value)).decode()
        send_msg(self._sock, {"op": "set", "key": key, "value": value_b64})

    def get(self, key: str) -> bytes:
        send_msg(self._sock, {"op": "get", "key": key})
        reply = recv_msg(self._sock)
        if "value" not in reply:
            raise TimeoutError(reply.get("error", f"rendezvous key {key!r} failed"))
        return base64.b64decode(reply["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self.get(k) is not None for k in keys)


def serve_store_ops(sock: socket.socket, store: DictStore) -> bool:
    """Answer a puller's store traffic until it reports done (True) or gives up (False)."""
    while True:
        msg = recv_msg(sock)
        match msg.get("op"):
            case "set":
                store.set(str(msg["key"]), base64.b64decode(msg["value"]))
            case "get":
                try:
                    value = store.get(str(msg["key"]))
                except TimeoutError as exc:
                    send_msg(sock, {"error": str(exc)})
                    return False
                send_msg(sock, {"value": base64.b64encode(value).decode()})
            case "done":
                return True
            case "abort":
                return False
            case other:
                raise ConnectionError(f"unknown control op {other!r}")
