"""Moving KV blocks and other tensor buffers between processes.

``make_connector(backend)`` builds a ``KVConnector`` (see ``kvtransfer.connector``
for the call order and ownership rules). Backends are registered by name and
imported only when asked for, so ``local`` works without NIXL or a network.

Exceptions::

    KVTransferError (RuntimeError)
    └── UnknownHandleError        the handle's blocks were released, expired or never held
    LayoutMismatchError (ValueError)   the two sides' KV layouts differ
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

from kvtransfer.connector import (
    KVConnector,
    KVTransferError,
    ReleaseCallback,
    ReportsOpenTransfers,
    UnknownHandleError,
)
from kvtransfer.memory import advise_huge_pages, alloc_region
from kvtransfer.types import BlockHandle, KVLayout, LayoutMismatchError, TransferState

__all__ = [
    "BlockHandle",
    "KVConnector",
    "KVLayout",
    "KVTransferError",
    "LayoutMismatchError",
    "ReleaseCallback",
    "ReportsOpenTransfers",
    "TransferState",
    "UnknownHandleError",
    "advise_huge_pages",
    "alloc_region",
    "available_backends",
    "make_connector",
]

# name -> (module, class); modules are imported on first use.
_BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("kvtransfer.local", "LocalConnector"),
    "nixl": ("kvtransfer.nixl_backend", "NixlConnector"),
    "torch": ("kvtransfer.torch_backend", "TorchConnector"),
}

# the third-party module each backend needs, to tell what this machine can run
_REQUIRES: dict[str, str] = {"nixl": "nixl._api", "torch": "torch.distributed"}


def available_backends() -> list[str]:
    """Registered backends whose dependencies import on this machine."""
    names = []
    for name in _BACKENDS:
        try:
            if name in _REQUIRES:
                importlib.import_module(_REQUIRES[name])
        except ImportError:
            continue
        names.append(name)
    return names


def make_connector(
    backend: str,
    *,
    agent_name: str | None = None,
    lease_s: float = 30.0,
    transfer_timeout_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> KVConnector:
    """Build a connector. ``options`` go to the backend (e.g. ``host=`` for ``torch``,
    the address it advertises and binds to; default this node's routable address)."""
    try:
        module_name, class_name = _BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown KV backend {backend!r}; known: {sorted(_BACKENDS)}") from None
    cls = getattr(importlib.import_module(module_name), class_name)
    conn: KVConnector = cls(
        agent_name=agent_name,
        lease_s=lease_s,
        transfer_timeout_s=transfer_timeout_s,
        clock=clock,
        **options,
    )
    return conn
