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
from services.cluster.serve import ADDRESS_IN_USE_EXIT

__all__ = [
    "ROOT",
    "NotServing",
    "baton_serving",
    "child_env",
    "free_port",
    "start_baton",
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


# A port is free when picked and bound a moment later, when the child has imported
# its code (``baton serve`` binds before Ray starts): a port another process took in
# between is picked again. ``baton serve`` says so with ``ADDRESS_IN_USE_EXIT``.
_BIND_ATTEMPTS = 3


def start_baton(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    path: str = "/v1/models",
    poll_s: float = 1.0,
    pipe_output: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """``python -m services.cli ARGS --port P`` (``serve`` or ``gateway``) on a free port,
    picking another while the one picked is taken; returns the process and its base URL
    once ``GET path`` answers 200. Its output goes to stderr (a benchmark's stdout is its
    JSON lines), or to ``proc.stdout`` with ``pipe_output``. Raises ``NotServing``."""
    for attempt in range(_BIND_ATTEMPTS):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args, "--port", str(port)],
            cwd=ROOT,
            env=child_env() if env is None else env,
            stdout=subprocess.PIPE if pipe_output else sys.stderr,
            stderr=subprocess.STDOUT if pipe_output else None,
            text=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_serving(url, proc, timeout_s, path=path, poll_s=poll_s)
        except NotServing:
            stop(proc, grace_s=0)
            if proc.returncode == ADDRESS_IN_USE_EXIT and attempt < _BIND_ATTEMPTS - 1:
                continue
            raise
        except BaseException:
            stop(proc, grace_s=0)
            raise
        return proc, url
    raise AssertionError("unreachable: the last attempt returns or raises")


@contextmanager
def baton_serving(args: Sequence[str], timeout_s: float = 180.0) -> Iterator[str]:
    """``baton serve ARGS`` on a free 127.0.0.1 port, its own Ray, until the block ends;
    yields the base URL once ``/v1/models`` answers (its workers are up)."""
    proc, url = start_baton(["serve", *args], timeout_s=timeout_s)
    try:
        yield url
    finally:
        stop(proc, grace_s=60)
