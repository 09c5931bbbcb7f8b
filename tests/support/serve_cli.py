"""``baton serve`` as a subprocess, the way a user runs it (for e2e tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from loadgen.server_proc import ROOT, NotServing, child_env, free_port, stop, wait_until_serving

__all__ = ["ROOT", "baton_serve", "free_port", "serve_env"]


# The port is free when picked and taken seconds later, after Ray has started: a port
# another process took meanwhile (Ray's own servers bind free ports too) is picked again.
_BIND_ATTEMPTS = 3


@contextmanager
def baton_serve(args: list[str], env: dict[str, str], ready_s: float) -> Iterator[str]:
    for attempt in range(_BIND_ATTEMPTS):
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
        except NotServing as e:
            stop(proc, grace_s=0)
            if "address already in use" in str(e) and attempt < _BIND_ATTEMPTS - 1:
                continue
            raise
        except BaseException:
            stop(proc, grace_s=0)
            raise
        break
    try:
        yield base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
        assert f"http://127.0.0.1:{port}/v1" in output  # it said where it listens
    finally:
        stop(proc, grace_s=0)


serve_env = child_env  # the environment a user's shell gives ``baton serve``
