"""A slot that keeps crashing is restarted with a doubling backoff, and readiness says so."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from router.types import Role
from services.cluster.controller import Controller, ControllerConfig
from services.cluster.factories import FakeEngineFactory
from services.cluster.launchers import launch_in_process
from services.workers.client import WorkerDiedError
from services.workers.messages import WorkerSnapshot
from services.workers.worker import WorkerSpec


class CrashingFakeClient:
    """A real in-process fake worker whose telemetry ends in a crash after one snapshot."""

    def __init__(self, spec: WorkerSpec) -> None:
        self._inner = launch_in_process(spec)
        self.worker_id = spec.worker_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        async for snapshot in self._inner.telemetry():
            yield snapshot
            await asyncio.sleep(0.02)
            raise WorkerDiedError(self.worker_id, "crashed on purpose")


async def test_repeated_crashes_back_off_and_readiness_shows_the_slot_down() -> None:
    launched: list[tuple[str, float]] = []

    def launch(spec: WorkerSpec) -> CrashingFakeClient:
        launched.append((spec.worker_id, time.monotonic()))
        return CrashingFakeClient(spec)

    controller = Controller(
        [WorkerSpec("w0", Role.MIXED, FakeEngineFactory(), telemetry_interval_s=0.01)],
        launch,  # type: ignore[arg-type]
        on_snapshot=lambda s: None,
        on_worker_down=lambda worker_id, role: None,
        config=ControllerConfig(
            ping_interval_s=10, restart_backoff_s=0.3, max_restart_backoff_s=0.6, crash_window_s=60
        ),
    )
    await controller.start()
    states: set[str] = set()
    try:
        deadline = time.monotonic() + 10
        while len(launched) < 5 and time.monotonic() < deadline:
            states |= {f"{w.worker_id}:{w.state}" for w in controller.readiness()}
            await asyncio.sleep(0.01)
        ids = [w for w, _ in launched]
        assert ids[:5] == ["w0", "w0.r1", "w0.r2", "w0.r3", "w0.r4"]
        gaps = [b - a for (_, a), (_, b) in itertools.pairwise(launched)]
        assert gaps[0] < 0.25  # the first crash: replaced at once
        assert 0.3 <= gaps[1] < 0.6 + 0.25  # then 0.3 s, 0.6 s, capped at 0.6 s
        assert gaps[2] >= 0.6 and 0.6 <= gaps[3] < 1.2
        assert "w0.r1:down" in states  # between a crash and its restart
        down = [w for w in controller.readiness() if w.state == "down"]
        assert all("crashed on purpose" in (w.reason or "") for w in down)
    finally:
        await controller.stop()


async def test_a_slot_that_came_back_up_is_reported_ready_only() -> None:
    controller = Controller(
        [WorkerSpec("w0", Role.MIXED, FakeEngineFactory(), telemetry_interval_s=0.01)],
        launch_in_process,
        on_snapshot=lambda s: None,
        on_worker_down=lambda worker_id, role: None,
        config=ControllerConfig(ping_interval_s=10),
    )
    await controller.start()
    try:
        controller.report_dead("w0")
        assert [(w.worker_id, w.state) for w in controller.readiness()] == [
            ("w0", "down"),
            ("w0.r1", "starting"),
        ]
        for _ in range(300):
            if [w.state for w in controller.readiness()] == ["ready"]:
                break
            await asyncio.sleep(0.01)
        assert [(w.worker_id, w.state) for w in controller.readiness()] == [("w0.r1", "ready")]
    finally:
        await controller.stop()
