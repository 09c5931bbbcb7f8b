"""The controller's liveness pings: slow answers are tolerated, a hung worker is not."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from router.types import Role
from services.cluster.controller import Controller, ControllerConfig
from services.cluster.factories import FakeEngineFactory
from services.cluster.launchers import launch_in_process
from services.workers.worker import WorkerSpec


class SlowPingClient:
    """A real in-process worker whose first ``hangs`` pings never answer (None: all)."""

    def __init__(self, spec: WorkerSpec, hangs: int | None) -> None:
        self._inner = launch_in_process(spec)
        self._hangs = hangs
        self.pings = 0
        self.killed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def ping(self) -> str:
        self.pings += 1
        if self._hangs is None or self.pings <= self._hangs:
            await asyncio.sleep(3600)
        return await self._inner.ping()

    def kill(self) -> None:
        self.killed = True
        self._inner.kill()


async def test_two_slow_pings_are_tolerated_and_a_hung_worker_is_taken_down() -> None:
    clients: dict[str, SlowPingClient] = {}

    def launch(spec: WorkerSpec) -> SlowPingClient:
        hangs = {"slow": 2, "hung": None}.get(spec.worker_id, 0)
        clients[spec.worker_id] = SlowPingClient(spec, hangs)
        return clients[spec.worker_id]

    specs = [WorkerSpec(w, Role.MIXED, FakeEngineFactory()) for w in ("slow", "hung")]
    down: list[str] = []
    controller = Controller(
        specs,
        launch,  # type: ignore[arg-type]
        on_snapshot=lambda s: None,
        on_worker_down=lambda worker_id, role: down.append(worker_id),
        config=ControllerConfig(
            ping_interval_s=0.02, ping_timeout_s=0.05, ping_misses_to_down=3, replace_dead=False
        ),
    )
    await controller.start()
    try:
        for _ in range(200):
            if down and clients["slow"].pings > 4:
                break
            await asyncio.sleep(0.01)
        assert down == ["hung"] and clients["hung"].killed
        assert clients["hung"].pings >= 3  # not before the third miss
        assert "slow" in controller.workers() and not clients["slow"].killed
    finally:
        await controller.stop()


async def test_a_briefly_busy_gateway_loop_kills_no_healthy_worker() -> None:
    """The event loop held for longer than a ping's timeout, again and again: each
    stall costs at most one missed ping, and misses reset on the next answer."""
    down: list[str] = []
    specs = [WorkerSpec(f"w{i}", Role.MIXED, FakeEngineFactory()) for i in range(2)]
    controller = Controller(
        specs,
        launch_in_process,
        on_snapshot=lambda s: None,
        on_worker_down=lambda worker_id, role: down.append(worker_id),
        config=ControllerConfig(
            ping_interval_s=0.02, ping_timeout_s=0.05, ping_misses_to_down=3, replace_dead=False
        ),
    )
    await controller.start()
    try:
        for _ in range(6):
            await asyncio.sleep(0.2)  # pings answer (and reset the misses); one is in flight
            time.sleep(0.3)  # the loop is busy: 6x the ping timeout
        await asyncio.sleep(0.3)
        assert down == []
        assert set(controller.workers()) == {"w0", "w1"}
    finally:
        await controller.stop()
