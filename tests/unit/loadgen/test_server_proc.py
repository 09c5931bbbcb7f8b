"""The one helper that starts servers for tests and benchmarks: it waits for a real
answer, reports a server that died with what it printed, and stops what it started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadgen.server_proc import NotServing, free_port, stop, wait_until_serving


def test_a_server_that_exits_is_reported_with_its_output() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with pytest.raises(NotServing, match=r"exited with 3[\s\S]*no model here"):
        wait_until_serving(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30, poll_s=0.05)


def test_waits_for_a_real_answer_then_stops_the_server() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        waited_s = wait_until_serving(f"http://127.0.0.1:{port}", proc, 30, path="/", poll_s=0.05)
        assert 0.0 <= waited_s < 30
    finally:
        code = stop(proc, grace_s=10)
    assert proc.poll() is not None and code != 0  # SIGTERM ended it


def test_a_silent_server_times_out() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(NotServing, match="not serving within"):
            wait_until_serving(f"http://127.0.0.1:{free_port()}", proc, timeout_s=0.3, poll_s=0.05)
    finally:
        stop(proc, grace_s=5)
    assert proc.poll() is not None
