"""``baton serve`` as a subprocess, the way a user runs it (for e2e tests)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from loadgen.server_proc import ROOT, child_env, free_port, start_baton, stop

__all__ = ["ROOT", "baton_serve", "free_port", "serve_env"]


@contextmanager
def baton_serve(args: list[str], env: dict[str, str], ready_s: float) -> Iterator[str]:
    """``baton serve ARGS`` until the block ends; then SIGTERM, which must end it with
    status 0, and its output must have said where it listens."""
    proc, base = start_baton(
        ["serve", *args], env=env, timeout_s=ready_s, path="/health", poll_s=0.25, pipe_output=True
    )
    try:
        yield base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
        assert f"{base}/v1" in output  # it said where it listens
    finally:
        stop(proc, grace_s=0)


serve_env = child_env  # the environment a user's shell gives ``baton serve``
