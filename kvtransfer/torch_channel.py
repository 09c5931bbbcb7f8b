"""One two-rank process group per (puller, holder) pair, reused pull after pull.

Building a gloo pair costs tens of milliseconds (far more than moving a few
MiB), so a puller opens one channel per holder and keeps it: a control socket
plus a group whose rendezvous ran over that socket. Pulls on a channel take
turns; any error closes it and the next pull opens a fresh one.

    puller                                   holder (one thread per channel)
    hello {device}            ───▶           rank 0 of a new group
    rank 1; rendezvous        ◀──▶           (store ops over the socket), "done"
    -- then, per pull --
    pull {transfer_id}        ───▶           lend: pin the hold, or refuse
    recv into staging         ◀───           send the held blocks
    done | abort              ───▶           done: completion queued; unpin
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from kvtransfer.connector import UnknownHandleError
from kvtransfer.wire import DictStore, SocketStore, recv_msg, send_msg, serve_store_ops

__all__ = ["PullChannel", "make_group", "serve_channel"]

log = logging.getLogger(__name__)


def make_group(store: Any, rank: int, host: str, device: torch.device, timeout_s: float) -> Any:
    """A two-rank group outside torch.distributed's global state: NCCL on CUDA, else gloo."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=timeout_s)
        group: Any = dist.ProcessGroupNCCL(store, rank, 2, nccl_opts)
        # NCCL builds its communicator at the first send/recv, through the store; do it
        # now, while the rendezvous is being served, not inside the first pull.
        probe = torch.zeros(1, device=device)
        (group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)).wait()
        _sync(probe)
        return group
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:  # NCCL's wait() only orders the stream; callers need the bytes
        torch.cuda.current_stream(tensor.device).synchronize()


class PullChannel:
    """The puller's end. Hold ``lock`` for a whole pull."""

    def __init__(self, sock: socket.socket, group: Any, store: SocketStore) -> None:
        self.lock = threading.Lock()
        self.broken = False
        self._sock = sock
        self._group = group
        self._store: SocketStore | None = store  # the group calls back into it

    @classmethod
    def open(cls, host: str, port: int, device: torch.device, timeout_s: float) -> PullChannel:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_msg(sock, {"op": "hello", "device": device.type})
            # our end listens on the interface that reaches the holder
            my_host = sock.getsockname()[0]
            store = SocketStore(sock)
            group = make_group(store, 1, my_host, device, timeout_s)
            send_msg(sock, {"op": "done"})
        except BaseException:
            sock.close()
            raise
        return cls(sock, group, store)

    def request(self, transfer_id: str) -> None:
        send_msg(self._sock, {"op": "pull", "transfer_id": transfer_id})
        reply = recv_msg(self._sock)
        if not reply.get("ok"):
            raise UnknownHandleError(str(reply.get("error", "refused")))

    def receive(self, staging: torch.Tensor) -> None:
        self._group.recv([staging], 0, 0).wait()
        _sync(staging)

    def finish(self, used: bool) -> None:
        send_msg(self._sock, {"op": "done" if used else "abort"})

    def close(self) -> None:
        self.broken = True
        self._sock.close()
        self._group = None  # destroy the group here, not at interpreter exit
        self._store = None


Lend = Callable[[str], "torch.Tensor | None"]  # pin a hold and give its blocks, or None
EndLoan = Callable[[str, bool], None]  # (transfer_id, completed): unpin, record


def serve_channel(
    sock: socket.socket,
    host: str,
    timeout_s: float,
    lend: Lend,
    end_loan: EndLoan,
    closed: threading.Event,
    cuda_device: torch.device | None = None,
) -> None:
    """The holder's end: rendezvous, then answer pulls until the puller hangs up.

    A CUDA puller gets a NCCL rank on ``cuda_device`` (the GPU the holder's blocks live
    on; NCCL wants a GPU per rank), else on this thread's current GPU.
    """
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hello = recv_msg(sock)
    if hello.get("device") == "cuda":
        device = cuda_device or torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rendezvous = _rendezvous_rank0(sock, host, device, timeout_s)
    if rendezvous is None:
        return
    group, _store = rendezvous  # _store: held for as long as the group lives
    while not closed.is_set():
        sock.settimeout(None)  # an idle channel waits for the puller's next pull
        msg = recv_msg(sock)
        sock.settimeout(timeout_s)
        transfer_id = str(msg["transfer_id"])
        blocks = lend(transfer_id)
        if blocks is None:
            send_msg(sock, {"ok": False, "error": f"blocks of {transfer_id!r} are not held"})
            continue
        completed = False
        try:
            send_msg(sock, {"ok": True})
            blocks = blocks.to(device)
            group.send([blocks], 1, 0).wait()
            _sync(blocks)
            completed = recv_msg(sock).get("op") == "done"
        finally:
            end_loan(transfer_id, completed)


def _rendezvous_rank0(
    sock: socket.socket, host: str, device: torch.device, timeout_s: float
) -> tuple[Any, DictStore] | None:
    """The group and its store (which must outlive it), or None if the rendezvous failed."""
    store = DictStore(timeout_s)
    made: list[Any] = []

    def build() -> None:
        try:
            made.append(make_group(store, 0, host, device, timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            log.warning("channel rendezvous failed: %s", exc)

    builder = threading.Thread(target=build, name="kv-torch-rendezvous", daemon=True)
    builder.start()
    finished = serve_store_ops(sock, store)
    builder.join(timeout_s)
    return (made[0], store) if finished and made else None
