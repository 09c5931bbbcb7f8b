"""In-process reference backend: a pull is a tensor copy between two connectors.

It defines the contract the other backends are tested against. Connectors find
each other through a ``LocalFabric`` (one per process by default, since this
backend's whole point is peers that share an address space).
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvtransfer.connector import ReleaseCallback, UnknownHandleError
from kvtransfer.leases import LeaseTable
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

__all__ = ["LocalConnector", "LocalFabric"]


class LocalFabric:
    """Name -> connector, for connectors in one process."""

    def __init__(self) -> None:
        self._agents: weakref.WeakValueDictionary[str, LocalConnector] = (
            weakref.WeakValueDictionary()
        )

    def add(self, conn: LocalConnector) -> None:
        self._agents[conn.agent_name] = conn

    def remove(self, agent_name: str) -> None:
        self._agents.pop(agent_name, None)

    def get(self, agent_name: str) -> LocalConnector | None:
        return self._agents.get(agent_name)


DEFAULT_FABRIC = LocalFabric()


class LocalConnector:
    name = "local"

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        fabric: LocalFabric = DEFAULT_FABRIC,
    ) -> None:
        self.agent_name = agent_name or f"local-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s  # copies are synchronous; kept for parity
        self._regions: dict[str, Region] = {}
        self._leases = LeaseTable(clock)
        self._states = StateTable()
        self._done_inbox: deque[str] = deque()  # completions reported by pullers
        self._fabric = fabric
        fabric.add(self)

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
        hold = self._leases.add(region, block_ids, lease_s or self.lease_s, on_release)
        return describe_hold(self.name, self.agent_name, reg, hold)

    def pull(self, handle: BlockHandle, region: str, local_block_ids: Sequence[int]) -> str:
        local = check_pull(self.name, self._regions, handle, region, local_block_ids)
        holder = self._fabric.get(handle.agent)
        if holder is None:
            raise UnknownHandleError(f"agent {handle.agent!r} is gone")
        src = holder._regions.get(handle.region)
        if holder._leases.pin(handle.transfer_id) is None or src is None:
            raise UnknownHandleError(f"blocks of {handle.transfer_id!r} are not held")
        try:
            self._states.set(handle.transfer_id, TransferState.TRANSFERRING)
            dst_ids = list(local_block_ids)
            local.tensor[dst_ids] = src.tensor[list(handle.block_ids)].to(local.tensor.device)
        finally:
            holder._leases.unpin(handle.transfer_id)
        holder._done_inbox.append(handle.transfer_id)
        self._states.set(handle.transfer_id, TransferState.DONE)
        return handle.transfer_id

    def poll(self, transfer_id: str) -> TransferState:
        return self._states.get(transfer_id)

    def release(self, transfer_id: str) -> None:
        self._leases.release(transfer_id)

    def progress(self) -> None:
        while self._done_inbox:
            self._leases.release(self._done_inbox.popleft())
        self._leases.collect()

    def num_open_transfers(self) -> int:
        return 0

    def close(self) -> None:
        self._fabric.remove(self.agent_name)
        self._leases.release_all()

    def _region(self, region: str) -> Region:
        return lookup_region(self._regions, region)
