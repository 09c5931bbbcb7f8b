"""Joining the Ray cluster that ``baton cluster`` and ``baton gateway`` run in (and
``baton serve --ray-address``).

The address is ``--ray-address``, else ``$RAY_ADDRESS``, else ``auto``: the cluster that
``ray start --head`` began on this machine. Ray (2.5x on) starts such a cluster with
token authentication and sends the local token (``~/.ray/auth_token``) only to a cluster
it found itself (``auto``); to an address given explicitly, only with
``RAY_AUTH_MODE=token`` set. Joined without it, Ray retries for about 20 s and fails
with "Failed to connect to Ray cluster", naming no cause; ``join`` says which.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["AUTO", "join", "join_failure", "ray_address"]

AUTO = "auto"
_NOT_FOUND = "Could not find any running Ray instance"  # Ray's words for ``auto`` finding none


def ray_address(flag: str | None, environ: Mapping[str, str]) -> str:
    """``--ray-address``, else ``$RAY_ADDRESS``, else ``auto`` (this machine's cluster)."""
    return flag or environ.get("RAY_ADDRESS") or AUTO


def join(address: str, command: str, namespace: str, *, log_to_driver: bool = False) -> bool:
    """``ray.init`` into the cluster at ``address``; False once the one line that says why
    it could not is printed (``command`` then exits 1)."""
    import ray

    where = "this machine's Ray cluster" if address == AUTO else f"the Ray cluster at {address}"
    print(f"{command}: joining {where} ...", file=sys.stderr, flush=True)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)
    except ConnectionError as e:
        why = join_failure(address, str(e), os.environ, Path.home())
        print(f"{command}: {why}", file=sys.stderr)
        return False
    return True


def join_failure(address: str, error: str, environ: Mapping[str, str], home: Path) -> str:
    """What to tell the user when joining ``address`` raised ``error``."""
    if address == AUTO and _NOT_FOUND in error:
        return (
            "no Ray cluster is running on this machine: start one with `ray start --head`, "
            "or name one with --ray-address (or RAY_ADDRESS)"
        )
    if address == AUTO:  # found, but it would not have us
        return f"cannot join this machine's Ray cluster ({error})"
    reason = f"cannot join the Ray cluster at {address} ({error})"
    if environ.get("RAY_AUTH_MODE") is None and _has_token(environ, home):
        reason += (
            "; if it uses token authentication (`ray start` does by default), Ray sends "
            "this machine's token to an address given explicitly only with "
            "RAY_AUTH_MODE=token set; for the cluster on this machine, --ray-address auto "
            "finds it and sends it"
        )
    return reason


def _has_token(environ: Mapping[str, str], home: Path) -> bool:
    """A Ray token is at hand: in the environment, or in the file Ray reads it from."""
    if environ.get("RAY_AUTH_TOKEN"):
        return True
    path = environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (home / ".ray" / "auth_token").is_file()
