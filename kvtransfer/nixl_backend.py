"""NIXL backend: one-sided READs over UCX (cma/shm/TCP on CPU, RDMA and GPU-direct where present).

How a pull works, all driven from the puller's thread by polling (the NIXL
progress thread is off: on few cores it is 3-8x slower than polling):

1. ``hold`` writes a fresh generation number into a slot of the holder's
   *lease board* (a small registered int64 array) and puts the holder's agent
   metadata, region base address, block stride and board slot into
   ``BlockHandle.peer_info``. Board layout (``S`` slots): ``[0, S)`` live
   generations, ``[S, 2S)`` done marks written by pullers, ``[2S, 3S)``
   landing cells for this agent's own pulls.
2. ``pull`` adds the holder's agent on first use (cached per agent), prepares
   the remote region's block list once per (agent, region), and posts ONE
   prepped READ covering every block of the request (block-major layout: one
   block across all layers is one descriptor).
3. When the data has landed, an 8-byte READ of the holder's board slot
   confirms the hold was still live: holds are never revived, so a live slot
   after the data read means the blocks were held throughout. A released or
   expired hold therefore ends ``FAILED``.
4. The completion notification is an 8-byte WRITE of the generation into the
   slot's done mark; the holder's ``progress`` finds marks equal to live
   generations (one vector compare) and frees those blocks. A NIXL
   notification was tried first: it made the READ's completion wait for the
   holder's next progress call (+1 ms at a 0.1 ms holder loop, +20 ms at a
   20 ms one), whereas one-sided marks never wait on the holder.
"""

from __future__ import annotations

import itertools
import logging
import os
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
from kvtransfer.nixl_peer import PeerInfo, strided_rows
from kvtransfer.regions import (
    Region,
    check_block_ids,
    check_pull,
    describe_hold,
    lookup_region,
    make_region,
)
from kvtransfer.states import StateTable
from kvtransfer.types import BlockHandle, KVLayout, TransferState

__all__ = ["NixlConnector"]

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_BOARD = "__lease_board__"
_CHECK, _MARK = "check", "mark"


@dataclass(slots=True)
class _Pull:
    transfer_id: str
    peer: str
    xfer: Any  # the live nixl_xfer_handle (data READ, then board READ)
    phase: str  # "data" READ, lease "check" READ, done "mark" WRITE
    landing: int  # our board index the holder's slot lands in
    info: PeerInfo
    deadline_s: float


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
        if torch.cuda.is_available():
            # UCX's cuda_ipc serves READs only where it sees NVLink; elsewhere (PCIe, one
            # GPU) a VRAM pull falls back to "software emulation" over TCP: measured on one
            # H100, 256 MiB at 0.43 GB/s that way against 432 GB/s. A user's setting wins.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.agent_name, config)
        # Lease board: live generations, done marks, landing cells (see module doc).
        self._num_slots = num_board_slots
        self._board = torch.zeros(3 * num_board_slots, dtype=torch.int64)
        self._board_reg = self._agent.register_memory(self._board)
        self._board_local = self._agent.prep_xfer_dlist(
            _LOCAL, strided_rows(self._board.data_ptr(), 8, 0, 3 * num_board_slots), "DRAM"
        )
        self._free_slots: deque[int] = deque(range(num_board_slots))
        self._free_landings: deque[int] = deque(range(2 * num_board_slots, 3 * num_board_slots))
        self._slot_holds: dict[int, str] = {}  # slot -> transfer id
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
        self._slot_holds[slot] = hold.transfer_id
        info = PeerInfo(
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
        return describe_hold(self.name, self.agent_name, reg, hold, info.encode())

    def release(self, transfer_id: str) -> None:
        self._leases.release(transfer_id)

    def progress(self) -> None:
        self._agent.get_new_notifs()  # drives UCX: peers' connection set-up needs it
        self._release_marked()
        self._leases.collect()
        for pull in list(self._pulls.values()):
            self._advance(pull)
        self._retry_zombies()

    def _release_marked(self) -> None:
        live = self._board[: self._num_slots]
        marks = self._board[self._num_slots : 2 * self._num_slots]
        for slot in torch.nonzero((marks == live) & (live != 0)).flatten().tolist():
            self._leases.release(self._slot_holds[slot])

    def _clear_slot(self, hold: Hold) -> None:
        # Zero the slot before the holder frees its blocks, so a check that
        # reads it afterwards sees the hold is gone.
        self._board[hold.slot] = 0
        self._board[self._num_slots + hold.slot] = 0
        self._slot_holds.pop(hold.slot, None)
        self._free_slots.append(hold.slot)

    # -- puller side -----------------------------------------------------

    def pull(self, handle: BlockHandle, region: str, local_block_ids: Sequence[int]) -> str:
        local = check_pull(self.name, self._regions, handle, region, local_block_ids)
        info = PeerInfo.decode(handle.peer_info)
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
            strided_rows(info.base_addr, info.block_bytes, info.device_id, info.num_blocks),
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
            phase="data",
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
        """Step data READ -> lease check READ -> done mark WRITE as far as they have got."""
        try:
            status = self._agent.check_xfer_state(pull.xfer)
            while status == "DONE" and pull.phase != _MARK:
                if pull.phase == _CHECK and not self._hold_was_live(pull):
                    self._finish(pull, TransferState.FAILED)
                    return
                self._next_phase(pull)
                status = self._agent.check_xfer_state(pull.xfer)
        except Exception as exc:  # NIXL raises its own binding errors
            self._fail(pull, f"NIXL error: {exc}")
            return
        if status == "DONE":
            self._finish(pull, TransferState.DONE)
        elif pull.phase == _MARK and (status == "ERR" or self._clock() > pull.deadline_s):
            # the bytes were verified; only the holder's early release is lost
            log.warning("pull %s: done mark not delivered; the lease frees it", pull.transfer_id)
            self._finish(pull, TransferState.DONE)
        elif status == "ERR":
            self._fail(pull, "transfer error (holder gone?)")
        elif self._clock() > pull.deadline_s:
            self._fail(pull, f"timed out after {self.transfer_timeout_s} s")

    def _hold_was_live(self, pull: _Pull) -> bool:
        return int(self._board[pull.landing]) == pull.info.generation

    def _next_phase(self, pull: _Pull) -> None:
        """Post the lease check after the data, or the done mark after the check."""
        self._agent.release_xfer_handle(pull.xfer)
        board = self._remote_dlist(
            pull.peer,
            _BOARD,
            strided_rows(pull.info.board_addr, 8, 0, 2 * pull.info.num_slots),
            "DRAM",
        )
        landing = np.asarray([pull.landing], dtype=np.int32)
        if pull.phase == "data":
            self._board[pull.landing] = -1
            op, remote_cell, pull.phase = "READ", pull.info.slot, _CHECK
        else:  # the landing cell now holds the generation: write it as the done mark
            op, remote_cell, pull.phase = "WRITE", pull.info.num_slots + pull.info.slot, _MARK
        pull.xfer = self._agent.make_prepped_xfer(
            op, self._board_local, landing, board, np.asarray([remote_cell], dtype=np.int32)
        )
        if self._agent.transfer(pull.xfer) == "ERR":
            raise KVTransferError(f"posting the lease {pull.phase} failed")

    def _finish(self, pull: _Pull, state: TransferState) -> None:
        try:
            self._agent.release_xfer_handle(pull.xfer)
        except Exception:  # could not cancel a stuck mark yet; retried in progress()
            self._zombies.append((pull.xfer, pull.landing))
        else:
            self._free_landings.append(pull.landing)
        del self._pulls[pull.transfer_id]
        if state is TransferState.FAILED:
            log.warning("pull %s refused: the hold was released or expired", pull.transfer_id)
        self._states.set(pull.transfer_id, state)

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
        return lookup_region(self._regions, region)

    @staticmethod
    def _block_list(reg: Region) -> np.ndarray:
        return strided_rows(reg.base_addr, reg.layout.block_bytes, _device_id(reg), reg.num_blocks)


def _mem_type(reg: Region) -> str:
    return "VRAM" if reg.is_cuda else "DRAM"


def _device_id(reg: Region) -> int:
    return int(reg.tensor.device.index or 0) if reg.is_cuda else 0
