"""``baton serve`` as a subprocess, the way a user runs it (for e2e tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from loadgen.server_proc import ROOT, child_env, free_port, stop, wait_until_serving

__all__ = ["ROOT", "baton_serve", "free_port", "serve_env"]


@contextmanager
def baton_serve(args: list[str], env: dict[str, str], ready_s: float) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", *args, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, proc, ready_s)
        yield base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
        assert f"http://127.0.0.1:{port}/v1" in output  # it said where it listens
    finally:
        stop(proc, grace_s=0)


serve_env = child_env  # the environment a user's shell gives ``baton serve``
