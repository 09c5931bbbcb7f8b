"""``baton bench`` against a real ``baton serve`` (tiny model, CPU), and live vs simulated.

Starts the server as a subprocess on a free 127.0.0.1 port with
deploy/configs/local.yaml, waits for /v1/models, then:

* a bench run completes with zero failed requests;
* the simulator, given the shipped tiny-cpu profile and the same workload,
  agrees with the live run within 20% on throughput and median TPOT.

TTFT is not compared: the built-in tiny model has random weights, so about
half of its output bytes are not complete UTF-8 characters; the gateway
holds such text back, and the client sees the first event later than the
first token (a trained model does not do this).
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.arrivals import RateSpec
from loadgen.client import BenchConfig, run_bench
from loadgen.scenario import WorkloadConfig
from loadgen.sim import SimConfig, simulate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("services.cluster.serve") is None, reason="no baton serve yet"
    ),
]

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = WorkloadConfig(
    input_len="uniform:32-512", output_len="uniform:8-64", num_requests=40, seed=1
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--config",
            "deploy/configs/local.yaml",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"baton serve exited with {proc.returncode}")
            time.sleep(1)
        else:
            pytest.fail("baton serve did not come up in 180 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_zero_failed_and_close_to_simulation(server: str) -> None:
    live = run_bench(BenchConfig(server, WORKLOAD, rate=RateSpec(2.0))).summary
    assert live["failed"] == 0 and live["completed"] == 40
    sim = simulate(
        SimConfig(workload=WORKLOAD, rate=RateSpec(2.0), num_prefill=1, num_decode=1)
    ).summary
    for key in ("request_throughput", "output_throughput", "median_tpot_ms"):
        assert sim[key] == pytest.approx(live[key], rel=0.2), key
