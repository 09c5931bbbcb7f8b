"""NIXL backend: one-sided READs over UCX (cma/shm/TCP on CPU, RDMA and GPU-direct where present).

How a pull works, all driven from the puller's thread by polling (the NIXL
progress thread is off: on few cores it is 3-8x slower than polling):

1. ``hold`` writes a fresh generation number into a slot of the holder's
   *lease board* (a small registered int64 array) and puts the holder's agent
   metadata, region base address, block stride and board slot into
   ``BlockHandle.peer_info``.
2. ``pull`` adds the holder's agent on first use (cached per agent), prepares
   the remote region's block list once per (agent, region), and posts ONE
   prepped READ covering every block of the request (block-major layout: one
   block across all layers is one descriptor).
3. When the data has landed, an 8-byte READ of the holder's board slot
   confirms the hold was still live: holds are never revived, so a live slot
   after the data read means the blocks were held throughout. This READ
   carries the completion notification, on which the holder's ``progress``
   frees the blocks. A released or expired hold therefore ends ``FAILED``.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.connector import KVTransferError, ReleaseCallback, UnknownHandleError
from kvtransfer.leases import Hold, LeaseTable
from kvtransfer.regions import Region, check_block_ids, check_pull, make_region
from kvtransfer.states import StateTable
from kvtransfer.types import BlockHandle, KVLayout, TransferState

__all__ = ["NixlConnector"]

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_BOARD = "__lease_board__"
_DONE_PREFIX = b"kvdone:"


@dataclass(frozen=True, slots=True)
class _PeerInfo:
    """What a puller needs to reach a hold; JSON in ``BlockHandle.peer_info``."""

    metadata: bytes
    base_addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str
    device_id: int
    board_addr: int
    num_slots: int
    slot: int
    generation: int

    def encode(self) -> bytes:
        fields = {k: getattr(self, k) for k in self.__slots__ if k != "metadata"}
        fields["metadata"] = base64.b64encode(self.metadata).decode()
        return json.dumps(fields, separators=(",", ":")).encode()

    @staticmethod
    def decode(raw: bytes) -> _PeerInfo:
        try:
            fields = json.loads(raw)
            fields["metadata"] = base64.b64decode(fields["metadata"])
            return _PeerInfo(**fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferError(f"malformed NIXL peer_info: {exc}") from exc


@dataclass(slots=True)
class _Pull:
    transfer_id: str
    peer: str
    xfer: Any  # the live nixl_xfer_handle (data READ, then board READ)
    checking: bool  # False: data READ in flight; True: board READ in flight
    landing: int  # our board index the holder's slot lands in
    info: _PeerInfo
    deadline_s: float


def _strided(addr: int, length: int, device_id: int, count: int) -> np.ndarray:
    return np.array([[addr, length, device_id, length, count]], dtype=np.int64)


class NixlConnector:
    name = "nixl"

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        num_board_slots: int = 4096,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.agent_name = agent_name or f"nixl-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        self._clock = clock
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.agent_name, config)
        # Lease board: [0, S) are slots lent with holds, [S, 2S) land our own checks.
        self._num_slots = num_board_slots
        self._board = torch.zeros(2 * num_board_slots, dtype=torch.int64)
        self._board_reg = self._agent.register_memory(self._board)
        self._board_local = self._agent.prep_xfer_dlist(
            _LOCAL, _strided(self._board.data_ptr(), 8, 0, 2 * num_board_slots), "DRAM"
        )
        self._free_slots: deque[int] = deque(range(num_board_slots))
        self._free_landings: deque[int] = deque(range(num_board_slots, 2 * num_board_slots))
        self._generations = itertools.count(1)
        self._regions: dict[str, Region] = {}
        self._region_regs: dict[str, Any] = {}
        self._region_local: dict[str, Any] = {}
        self._leases = LeaseTable(clock, on_free=self._clear_slot)
        self._metadata = self._agent.get_agent_metadata()
        self._peers: dict[str, bytes] = {}  # remote agent -> the metadata we loaded
        self._remote_dlists: dict[tuple[str, str], Any] = {}
        self._pulls: dict[str, _Pull] = {}
        self._zombies: list[tuple[Any, int]] = []  # xfers NIXL could not cancel yet
        self._states = StateTable()

    # -- holder side -----------------------------------------------------

    def register(self, region: str, tensor: Any, layout: KVLayout) -> None:
        if region in self._regions or region == _BOARD:
            raise ValueError(f"region {region!r} is already registered")
        reg = make_region(region, tensor, layout)
        self._region_regs[region] = self._agent.register_memory(reg.tensor)
        self._region_local[region] = self._agent.prep_xfer_dlist(
            _LOCAL, self._block_list(reg), _mem_type(reg)
        )
        self._regions[region] = reg
        self._metadata = self._agent.get_agent_metadata()

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
        if not self._free_slots:
            raise KVTransferError(f"more than {self._num_slots} holds outstanding")
        slot = self._free_slots.popleft()
        generation = next(self._generations)
        self._board[slot] = generation
        hold = self._leases.add(region, block_ids, lease_s or self.lease_s, on_release, slot)
        info = _PeerInfo(
            metadata=self._metadata,
            base_addr=reg.base_addr,
            num_blocks=reg.num_blocks,
            block_bytes=reg.layout.block_bytes,
            mem_type=_mem_type(reg),
            device_id=_device_id(reg),
            board_addr=self._board.data_ptr(),
            num_slots=self._num_slots,
            slot=slot,
            generation=generation,
        )
        return BlockHandle(
            backend=self.name,
            agent=self.agent_name,
            region=region,
            transfer_id=hold.transfer_id,
            block_ids=hold.block_ids,
            layout=reg.layout,
            expires_at_s=hold.expires_at_s,
            peer_info=info.encode(),
        )

    def release(self, transfer_id: str) -> None:
        self._leases.release(transfer_id)

    def progress(self) -> None:
        for msgs in self._agent.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(_DONE_PREFIX):
                    self._leases.release(msg[len(_DONE_PREFIX) :].decode())
        self._leases.collect()
        for pull in list(self._pulls.values()):
            self._advance(pull)
        self._retry_zombies()

    def _clear_slot(self, hold: Hold) -> None:
        # Zero the slot before the holder frees its blocks, so a check that
        # reads it afterwards sees the hold is gone.
        self._board[hold.slot] = 0
        self._free_slots.append(hold.slot)

    # -- puller side -----------------------------------------------------

    def pull(self, handle: BlockHandle, region: str, local_block_ids: Sequence[int]) -> str:
        local = check_pull(self.name, self._regions, handle, region, local_block_ids)
        info = _PeerInfo.decode(handle.peer_info)
        tid = handle.transfer_id
        if handle.agent == self.agent_name and self._leases.get(tid) is None:
            raise UnknownHandleError(f"blocks of {tid!r} are not held")
        if self._states.is_active(tid):
            raise KVTransferError(f"transfer {tid!r} is already being pulled")
        if info.num_blocks <= max(handle.block_ids):
            raise KVTransferError("handle names blocks outside the holder's region")
        if not self._free_landings:
            raise KVTransferError("too many pulls in flight")
        peer = self._ensure_peer(handle.agent, info.metadata)
        remote = self._remote_dlist(
            peer,
            handle.region,
            _strided(info.base_addr, info.block_bytes, info.device_id, info.num_blocks),
            info.mem_type,
        )
        xfer = self._agent.make_prepped_xfer(
            "READ",
            self._region_local[local.name],
            np.asarray(local_block_ids, dtype=np.int32),
            remote,
            np.asarray(handle.block_ids, dtype=np.int32),
        )
        pull = _Pull(
            tid,
            peer,
            xfer,
            checking=False,
            landing=self._free_landings.popleft(),
            info=info,
            deadline_s=self._clock() + self.transfer_timeout_s,
        )
        self._pulls[tid] = pull
        self._states.set(tid, TransferState.TRANSFERRING)
        try:
            posted = self._agent.transfer(xfer)
        except Exception as exc:  # NIXL raises its own binding errors
            posted, reason = "ERR", f"posting the READ failed: {exc}"
        else:
            reason = "posting the READ failed"
        if posted == "ERR":
            self._fail(pull, reason)
        return tid

    def poll(self, transfer_id: str) -> TransferState:
        pull = self._pulls.get(transfer_id)
        if pull is not None:
            self._advance(pull)
        return self._states.get(transfer_id)

    def num_open_transfers(self) -> int:
        return len(self._pulls) + len(self._zombies)

    def _advance(self, pull: _Pull) -> None:
        try:
            status = self._agent.check_xfer_state(pull.xfer)
            if status == "DONE" and not pull.checking:
                self._start_check(pull)
                status = self._agent.check_xfer_state(pull.xfer)
        except Exception as exc:  # NIXL raises its own binding errors
            self._fail(pull, f"NIXL error: {exc}")
            return
        if status == "ERR":
            self._fail(pull, "transfer error (holder gone?)")
        elif status == "DONE":
            self._finish(pull)
        elif self._clock() > pull.deadline_s:
            self._fail(pull, f"timed out after {self.transfer_timeout_s} s")

    def _start_check(self, pull: _Pull) -> None:
        self._agent.release_xfer_handle(pull.xfer)
        self._board[pull.landing] = -1
        board = self._remote_dlist(
            pull.peer,
            _BOARD,
            _strided(pull.info.board_addr, 8, 0, pull.info.num_slots),
            "DRAM",
        )
        pull.xfer = self._agent.make_prepped_xfer(
            "READ",
            self._board_local,
            np.asarray([pull.landing], dtype=np.int32),
            board,
            np.asarray([pull.info.slot], dtype=np.int32),
            notif_msg=_DONE_PREFIX + pull.transfer_id.encode(),
        )
        pull.checking = True
        if self._agent.transfer(pull.xfer) == "ERR":
            raise KVTransferError("posting the lease check failed")

    def _finish(self, pull: _Pull) -> None:
        live = int(self._board[pull.landing]) == pull.info.generation
        self._agent.release_xfer_handle(pull.xfer)
        self._free_landings.append(pull.landing)
        del self._pulls[pull.transfer_id]
        if live:
            self._states.set(pull.transfer_id, TransferState.DONE)
        else:
            log.warning("pull %s refused: the hold was released or expired", pull.transfer_id)
            self._states.set(pull.transfer_id, TransferState.FAILED)

    def _fail(self, pull: _Pull, reason: str) -> None:
        log.warning("pull %s failed: %s", pull.transfer_id, reason)
        self._pulls.pop(pull.transfer_id, None)
        self._states.set(pull.transfer_id, TransferState.FAILED)
        self._zombies.append((pull.xfer, pull.landing))
        self._retry_zombies()
        if not any(p.peer == pull.peer for p in self._pulls.values()):
            self._drop_peer(pull.peer)  # reconnect afresh next time

    def _retry_zombies(self) -> None:
        alive: list[tuple[Any, int]] = []
        for xfer, landing in self._zombies:
            try:
                self._agent.release_xfer_handle(xfer)  # cancels if still active
            except Exception:  # NIXL could not cancel yet; try again on the next progress
                alive.append((xfer, landing))
                continue
            self._free_landings.append(landing)
        self._zombies = alive

    def _ensure_peer(self, agent: str, metadata: bytes) -> str:
        if agent == self.agent_name:
            return agent  # loopback: prep_xfer_dlist takes our own name
        known = self._peers.get(agent)
        if known == metadata:
            return agent
        if known is not None:
            self._drop_peer(agent)  # the holder registered more memory since
        added = self._agent.add_remote_agent(metadata)
        name = added.decode() if isinstance(added, bytes) else str(added)
        if name != agent:
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"peer_info names agent {name!r}, handle says {agent!r}")
        self._peers[agent] = metadata
        return agent

    def _remote_dlist(self, peer: str, region: str, rows: np.ndarray, mem_type: str) -> Any:
        key = (peer, region)
        dlist = self._remote_dlists.get(key)
        if dlist is None:
            dlist = self._agent.prep_xfer_dlist(peer, rows, mem_type)
            self._remote_dlists[key] = dlist
        return dlist

    def _drop_peer(self, peer: str) -> None:
        for key in [k for k in self._remote_dlists if k[0] == peer]:
            self._remote_dlists.pop(key).release()
        if self._peers.pop(peer, None) is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as exc:  # already disconnected
                log.debug("remove_remote_agent(%s): %s", peer, exc)

    # -- shared ----------------------------------------------------------

    def close(self) -> None:
        for pull in list(self._pulls.values()):
            self._fail(pull, "connector closed")
        self._leases.release_all()
        for peer in list(self._peers):
            self._drop_peer(peer)
        for dlist in [*self._remote_dlists.values(), *self._region_local.values()]:
            dlist.release()
        self._remote_dlists.clear()
        self._board_local.release()
        for reg in self._region_regs.values():
            self._agent.deregister_memory(reg)
        self._agent.deregister_memory(self._board_reg)
        self._region_regs.clear()
        self._region_local.clear()

    def _region(self, region: str) -> Region:
        reg = self._regions.get(region)
        if reg is None:
            raise KeyError(f"region {region!r} is not registered")
        return reg

    @staticmethod
    def _block_list(reg: Region) -> np.ndarray:
        return _strided(reg.base_addr, reg.layout.block_bytes, _device_id(reg), reg.num_blocks)


def _mem_type(reg: Region) -> str:
    return "VRAM" if reg.is_cuda else "DRAM"


def _device_id(reg: Region) -> int:
    return int(reg.tensor.device.index or 0) if reg.is_cuda else 0
