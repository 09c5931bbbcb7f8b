"""``baton gateway --ray-address`` as a subprocess: a gateway process a test can kill."""

from __future__ import annotations

from loadgen.server_proc import start_baton, stop


class GatewayProcess:
    def __init__(self, ray_address: str, ready_s: float = 240.0) -> None:
        self.proc, self.base_url = start_baton(
            ["gateway", "--ray-address", ray_address],
            timeout_s=ready_s,
            path="/health",
            poll_s=0.25,
            pipe_output=True,
        )

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
