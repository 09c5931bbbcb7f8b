"""``baton gateway --ray-address`` as a subprocess: a gateway process a test can kill."""

from __future__ import annotations

import subprocess
import sys

from loadgen.server_proc import ROOT, child_env, free_port, stop, wait_until_serving


class GatewayProcess:
    def __init__(self, ray_address: str, ready_s: float = 240.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "gateway", "--ray-address", ray_address,
             "--port", str(self.port)],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        wait_until_serving(self.base_url, self.proc, ready_s)

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind runs in the gateway."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        return stop(self.proc)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.kill()
