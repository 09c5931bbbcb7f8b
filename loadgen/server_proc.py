"""A server as a child process: a free port, waiting until it serves, stopping it.

One copy of what the e2e tests and the benchmarks do around ``baton serve``,
``baton gateway`` and vLLM's API server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvtransfer.net import free_port

__all__ = [
    "ROOT",
    "NotServing",
    "baton_serving",
    "child_env",
    "free_port",
    "stop",
    "wait_until_serving",
]

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a Baton child: its own Ray (no ``RAY_ADDRESS``),
    this checkout on ``PYTHONPATH``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


class NotServing(RuntimeError):
    """The server process ended before it answered, or did not answer in time."""


def wait_until_serving(
    base_url: str,
    proc: subprocess.Popen[bytes] | subprocess.Popen[str],
    timeout_s: float,
    path: str = "/health",
    poll_s: float = 0.25,
) -> float:
    """Poll ``GET base_url + path`` until it answers 200; returns the seconds waited.

    Raises ``NotServing`` if the process ends first (with what it printed, when its
    output is a pipe) or after ``timeout_s``.
    """
    started_s = time.monotonic()
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            text = out.decode(errors="replace") if isinstance(out, bytes) else out
            raise NotServing(f"server exited with {proc.returncode} before serving\n{text}")
        if time.monotonic() - started_s > timeout_s:
            raise NotServing(f"{base_url} not serving within {timeout_s:.0f} s")
        try:
            if httpx.get(base_url + path, timeout=1).status_code == 200:
                return time.monotonic() - started_s
        except httpx.TransportError:
            pass
        time.sleep(poll_s)


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if it has not ended within ``grace_s``; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@contextmanager
def baton_serving(args: Sequence[str], timeout_s: float = 180.0) -> Iterator[str]:
    """``baton serve ARGS`` on a free 127.0.0.1 port, its own Ray, until the block ends;
    yields the base URL once ``/v1/models`` answers (its workers are up)."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", *args, "--port", str(port)]
    # Its output goes to stderr: a benchmark's stdout is its JSON lines.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, timeout_s, path="/v1/models", poll_s=1.0)
        yield url
    finally:
        stop(proc, grace_s=60)
