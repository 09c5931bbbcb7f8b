"""The address a worker advertises to peers on other nodes, and a free port to listen on."""

from __future__ import annotations

import os
import socket

__all__ = ["advertised_host", "free_port"]


def advertised_host() -> str:
    """``BATON_NODE_IP``, or the pod's IP the chart passes as ``BATON_POD_IP``, when set;
    else the address of the interface that routes off this machine (127.0.0.1 only when
    there is none)."""
    configured = os.environ.get("BATON_NODE_IP") or os.environ.get("BATON_POD_IP")
    if configured:
        return configured
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing: it picks a route
            host: str = s.getsockname()[0]
            return host
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (``""``: every interface) that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
