"""torch.distributed backend: two-sided send/recv, gloo on CPU and NCCL on CUDA.

The holder listens on the address it advertises in ``peer_info``; a puller
opens one channel per holder (``kvtransfer.torch_channel``: a control socket
plus a two-rank group built directly, never the global default group, so any
number of P/D pairs coexist in one process) and runs each pull on a thread:

    D (pull thread)                       P (one thread per channel)
    "pull" transfer_id              ───▶  pin the hold, or refuse (-> FAILED)
    recv into a staging buffer      ◀───  send the held blocks
    copy into local blocks, "done"  ───▶  queue the completion; progress() frees

The puller copies from staging into its blocks only if the pull has not been
failed by its deadline, so a late message can never write into blocks the
puller has already taken back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.connector import KVTransferError, ReleaseCallback, UnknownHandleError
from kvtransfer.leases import LeaseTable
from kvtransfer.net import advertised_host
from kvtransfer.regions import (
    Region,
    check_block_ids,
    check_pull,
    describe_hold,
    lookup_region,
    make_region,
)
from kvtransfer.states import StateTable
from kvtransfer.torch_channel import PullChannel, serve_channel
from kvtransfer.types import BlockHandle, KVLayout, TransferState

__all__ = ["TorchConnector"]

log = logging.getLogger(__name__)


def _held_tensor(region: Region, block_ids: tuple[int, ...]) -> torch.Tensor:
    first = block_ids[0]
    if block_ids == tuple(range(first, first + len(block_ids))):
        return region.tensor[first : first + len(block_ids)]  # a contiguous view: no copy
    return region.tensor[list(block_ids)]


def _scatter(pool: torch.Tensor, block_ids: list[int], blocks: torch.Tensor) -> None:
    first = block_ids[0]
    if block_ids == list(range(first, first + len(block_ids))):
        pool[first : first + len(block_ids)].copy_(blocks)
    else:
        index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        pool.index_copy_(0, index, blocks)


class _StagingPool:
    """Receive buffers kept warm between pulls: a fresh buffer's page faults
    would otherwise land inside the receive and halve its throughput."""

    def __init__(self, max_buffers: int = 4) -> None:
        self._free: list[torch.Tensor] = []
        self._max_buffers = max_buffers
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.shape == shape and buf.dtype == like.dtype and buf.device == like.device:
                    return self._free.pop(i)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            del self._free[: -self._max_buffers]


@dataclass(slots=True)
class _Pull:
    transfer_id: str
    deadline_s: float
    state: TransferState = TransferState.PENDING
    thread: threading.Thread | None = None
    cancelled: bool = False
    error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)


class TorchConnector:
    name = "torch"

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        host: str | None = None,
    ) -> None:
        self.agent_name = agent_name or f"torch-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        # Advertised in peer_info; every socket binds to it. Default: this node's
        # routable address, so a puller on another node can reach it.
        self.host = host or advertised_host()
        self._clock = clock
        self._regions: dict[str, Region] = {}
        self._leases = LeaseTable(clock)
        self._completed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._pulls: dict[str, _Pull] = {}
        self._lingering: list[threading.Thread] = []  # failed pulls' threads still unwinding
        self._states = StateTable()
        self._staging = _StagingPool()
        self._channels: dict[tuple[str, int, str], PullChannel] = {}
        self._channels_lock = threading.Lock()
        self._channel_socks: set[socket.socket] = set()  # holder ends, shut down on close
        self._channel_threads: list[threading.Thread] = []

    # -- holder side -----------------------------------------------------

    def register(self, region: str, tensor: Any, layout: KVLayout) -> None:
        if region in self._regions:
            raise ValueError(f"region {region!r} is already registered")
        self._regions[region] = make_region(region, tensor, layout)

    def hold(
        self,
        region: str,
        block_ids: Sequence[int],
        *,
        lease_s: float | None = None,
        on_release: ReleaseCallback | None = None,
    ) -> BlockHandle:
        reg = self._region(region)
        check_block_ids(reg, block_ids)
        port = self._ensure_listening()
        hold = self._leases.add(region, block_ids, lease_s or self.lease_s, on_release)
        return describe_hold(
            self.name,
            self.agent_name,
            reg,
            hold,
            json.dumps({"host": self.host, "port": port}).encode(),
        )

    def release(self, transfer_id: str) -> None:
        self._leases.release(transfer_id)

    def progress(self) -> None:
        while True:
            try:
                tid = self._completed.get_nowait()
            except queue.Empty:
                break
            self._leases.release(tid)
        self._leases.collect()
        for pull in list(self._pulls.values()):
            self.poll(pull.transfer_id)

    def _ensure_listening(self) -> int:
        if self._listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((self.host, 0))
            listener.listen(64)
            listener.settimeout(0.2)  # lets the accept loop notice close()
            self._listener = listener
            threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True).start()
        return int(self._listener.getsockname()[1])

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            thread = threading.Thread(target=self._serve_channel, args=(sock,), daemon=True)
            self._channel_threads.append(thread)
            thread.start()

    def _serve_channel(self, sock: socket.socket) -> None:
        self._channel_socks.add(sock)
        try:
            cuda = [r.tensor.device for r in self._regions.values() if r.is_cuda]
            serve_channel(
                sock,
                self.host,
                self.transfer_timeout_s,
                self._lend,
                self._end_loan,
                self._closed,
                cuda[0] if cuda else None,
            )
        except (OSError, ConnectionError, KeyError, ValueError, RuntimeError) as exc:
            if not self._closed.is_set():
                log.info("channel closed: %s", exc)
        finally:
            self._channel_socks.discard(sock)
            sock.close()

    def _lend(self, transfer_id: str) -> torch.Tensor | None:
        hold = self._leases.pin(transfer_id)
        if hold is None:
            return None
        region = self._regions.get(hold.region)
        if region is None:
            self._leases.unpin(transfer_id)
            return None
        return _held_tensor(region, hold.block_ids)

    def _end_loan(self, transfer_id: str, completed: bool) -> None:
        if completed:
            self._completed.put(transfer_id)  # freed on the holder's thread, in progress()
        self._leases.unpin(transfer_id)

    # -- puller side -----------------------------------------------------

    def pull(self, handle: BlockHandle, region: str, local_block_ids: Sequence[int]) -> str:
        local = check_pull(self.name, self._regions, handle, region, local_block_ids)
        tid = handle.transfer_id
        if handle.agent == self.agent_name and self._leases.get(tid) is None:
            raise UnknownHandleError(f"blocks of {tid!r} are not held")
        if self._states.is_active(tid):
            raise KVTransferError(f"transfer {tid!r} is already being pulled")
        try:
            addr = json.loads(handle.peer_info)
            host, port = str(addr["host"]), int(addr["port"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferError(f"malformed torch peer_info: {exc}") from exc
        pull = _Pull(tid, deadline_s=self._clock() + self.transfer_timeout_s)
        pull.thread = threading.Thread(
            target=self._run_pull,
            args=(pull, host, port, local, list(local_block_ids), len(handle.block_ids)),
            name=f"kv-torch-pull-{tid[:8]}",
            daemon=True,
        )
        self._pulls[tid] = pull
        self._states.set(tid, TransferState.PENDING)
        pull.thread.start()
        return tid

    def _run_pull(
        self,
        pull: _Pull,
        host: str,
        port: int,
        local: Region,
        local_ids: list[int],
        num_blocks: int,
    ) -> None:
        channel: PullChannel | None = None
        try:
            channel = self._channel(host, port, local.tensor.device)
            if not channel.lock.acquire(timeout=self.transfer_timeout_s):
                raise TimeoutError("the channel to the holder stayed busy")
            try:
                self._pull_on(channel, pull, local, local_ids, num_blocks)
            finally:
                channel.lock.release()
        except UnknownHandleError as exc:  # refused: the channel itself is fine
            self._end_pull(pull, str(exc))
        except (OSError, ConnectionError, RuntimeError, TimeoutError, KeyError) as exc:
            if channel is not None:
                self._drop_channel(host, port, local.tensor.device, channel)
            self._end_pull(pull, str(exc))

    def _pull_on(
        self,
        channel: PullChannel,
        pull: _Pull,
        local: Region,
        local_ids: list[int],
        num_blocks: int,
    ) -> None:
        if channel.broken:
            raise ConnectionError("channel closed while waiting for it")
        channel.request(pull.transfer_id)
        with pull.lock:
            if pull.state is TransferState.PENDING:
                pull.state = TransferState.TRANSFERRING
        staging = self._staging.take((num_blocks, *local.layout.block_shape), local.tensor)
        channel.receive(staging)
        with pull.lock:
            used = not pull.cancelled
            if used:
                _scatter(local.tensor, local_ids, staging)
                if staging.is_cuda:
                    torch.cuda.current_stream(staging.device).synchronize()
                pull.state = TransferState.DONE
        channel.finish(used)
        if used:  # a cancelled pull's buffer is not reused: nothing may write into it late
            self._staging.give(staging)

    def _end_pull(self, pull: _Pull, error: str) -> None:
        with pull.lock:
            pull.error = error
            if not pull.state.is_final:
                pull.state = TransferState.FAILED

    def _channel(self, host: str, port: int, device: torch.device) -> PullChannel:
        key = (host, port, str(device))
        with self._channels_lock:
            channel = self._channels.get(key)
            if channel is None or channel.broken:
                channel = PullChannel.open(host, port, device, self.transfer_timeout_s)
                self._channels[key] = channel
            return channel

    def _drop_channel(
        self, host: str, port: int, device: torch.device, channel: PullChannel
    ) -> None:
        with self._channels_lock:
            if self._channels.get((host, port, str(device))) is channel:
                del self._channels[(host, port, str(device))]
        channel.close()

    def poll(self, transfer_id: str) -> TransferState:
        pull = self._pulls.get(transfer_id)
        if pull is None:
            return self._states.get(transfer_id)
        with pull.lock:
            if not pull.state.is_final and self._clock() > pull.deadline_s:
                pull.cancelled = True
                pull.state = TransferState.FAILED
                pull.error = f"timed out after {self.transfer_timeout_s} s"
            state = pull.state
        if state.is_final:
            if state is TransferState.FAILED:
                log.warning("pull %s failed: %s", transfer_id, pull.error)
            del self._pulls[transfer_id]
            if pull.thread is not None and pull.thread.is_alive():
                self._lingering.append(pull.thread)
        self._states.set(transfer_id, state)
        return state

    def num_open_transfers(self) -> int:
        """Pulls not yet final plus puller threads still winding down after a failure."""
        self._lingering = [t for t in self._lingering if t.is_alive()]
        return len(self._pulls) + len(self._lingering)

    # -- shared ----------------------------------------------------------

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        for sock in list(self._channel_socks):
            with contextlib.suppress(OSError):  # already closed by its thread
                sock.shutdown(socket.SHUT_RDWR)  # wakes the channel threads
        for thread in self._channel_threads:
            # their groups must be destroyed before the interpreter exits, or
            # gloo aborts the process ("terminate called without an active exception")
            thread.join(timeout=1.0)
        for pull in list(self._pulls.values()):
            with pull.lock:
                pull.cancelled = True
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._leases.release_all()

    def _region(self, region: str) -> Region:
        return lookup_region(self._regions, region)
