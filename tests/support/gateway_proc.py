"""``baton gateway --ray-address`` as a subprocess: a gateway process a test can kill."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tests.support.serve_cli import ROOT, free_port, serve_env


class GatewayProcess:
    def __init__(self, ray_address: str, ready_s: float = 240.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--ray-address", ray_address,
             "--port", str(self.port)],
            cwd=ROOT,
            env=serve_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stdout.read() if self.proc.stdout else "")
            assert time.monotonic() < deadline, "gateway not ready in time"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind runs in the gateway."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=30)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()
