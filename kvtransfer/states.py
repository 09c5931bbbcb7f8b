"""Puller-side record of transfer states, kept bounded after they finish."""

from __future__ import annotations

from collections import OrderedDict

from kvtransfer.connector import UnknownHandleError
from kvtransfer.types import TransferState

__all__ = ["StateTable"]

_MAX_FINISHED = 4096


class StateTable:
    def __init__(self) -> None:
        self._states: OrderedDict[str, TransferState] = OrderedDict()

    def set(self, transfer_id: str, state: TransferState) -> None:
        self._states[transfer_id] = state
        self._states.move_to_end(transfer_id)
        while len(self._states) > _MAX_FINISHED and next(iter(self._states.values())).is_final:
            self._states.popitem(last=False)

    def get(self, transfer_id: str) -> TransferState:
        state = self._states.get(transfer_id)
        if state is None:
            raise UnknownHandleError(f"no pull with transfer id {transfer_id!r}")
        return state

    def is_active(self, transfer_id: str) -> bool:
        state = self._states.get(transfer_id)
        return state is not None and not state.is_final
