"""The one helper that starts servers for tests and benchmarks: it waits for a real
answer, reports a server that died with what it printed, and stops what it started."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from loadgen import server_proc
from loadgen.server_proc import (
    ROOT,
    NotServing,
    child_env,
    free_port,
    start_baton,
    stop,
    wait_until_serving,
)
from services.cluster.serve import ADDRESS_IN_USE_EXIT


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


@pytest.mark.slow  # a real ``baton serve`` process: about 2 s of imports
def test_baton_serve_reports_a_taken_port_before_starting_anything() -> None:
    """A port in use ends ``baton serve`` at once with its own status, before Ray and
    the workers start (it used to fail only once the model had loaded, with status 1)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "--model", "tiny", "--port", str(port)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == ADDRESS_IN_USE_EXIT, done.stderr
    assert f"127.0.0.1:{port}: address already in use" in done.stderr
    assert "Ray" not in done.stderr  # no local Ray instance was started


@pytest.mark.slow  # three ``baton serve`` processes
def test_start_baton_picks_another_port_while_the_one_picked_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        picked: list[int] = []

        def always_the_taken_port() -> int:
            picked.append(held.getsockname()[1])
            return picked[-1]

        monkeypatch.setattr(server_proc, "free_port", always_the_taken_port)
        with pytest.raises(NotServing, match=r"exited with 3[\s\S]*address already in use"):
            start_baton(["serve", "--model", "tiny"], timeout_s=60, pipe_output=True)
    assert len(picked) == 3  # tried three times, then gave up with the reason
