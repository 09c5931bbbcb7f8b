"""Gateways over a control plane they do not own (RemoteController), in process: two gateways
share the workers, each with its own router; one stopping leaves the workers to the other; a
worker leaving the registry or dying is down for each gateway and reported to the plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import httpx
import pytest

from router.types import Role
from services.backends.fake import FakeTokenizer
from services.cluster.control_plane import Registry, WorkerEntry, _base_id, _generation
from services.cluster.factories import ConnectorFactory, FakeEngineFactory
from services.cluster.remote import RemoteController
from services.cluster.specs import worker_specs
from services.gateway.app import create_app
from services.gateway.service import GatewayService, GatewaySettings
from services.workers.client import InProcessWorkerClient, WorkerClient
from services.workers.worker import Worker
from tests.unit.gateway.conftest import MODEL, fake_config

pytestmark = pytest.mark.asyncio


class _FakeMethod:
    """A Ray actor method's face: ``.remote(*args)`` starts the call at once (awaiting the
    result is optional, as with Ray)."""

    def __init__(self, fn: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        return asyncio.ensure_future(self._fn(*args))


class FakePlane:
    """The ``baton-controller`` actor's methods over in-process workers."""

    def __init__(self, workers: dict[str, Worker]) -> None:
        self.workers = workers
        self.reported_dead: list[str] = []
        self.start = _FakeMethod(self._registry)
        self.registry = _FakeMethod(self._registry)
        self.report_dead = _FakeMethod(self._report_dead)
        self.set_role = _FakeMethod(self._set_role)

    async def _registry(self) -> Registry:
        entries = tuple(
            WorkerEntry(wid, w._role, f"baton-worker-{wid}") for wid, w in self.workers.items()
        )
        return Registry(entries, True)

    async def _report_dead(self, worker_id: str) -> None:
        self.reported_dead.append(worker_id)

    async def _set_role(self, worker_id: str, role: Role) -> Role:
        return await self.workers[worker_id].set_role(role)

    def find(self, entry: WorkerEntry) -> WorkerClient | None:
        worker = self.workers.get(entry.worker_id)
        return InProcessWorkerClient(worker) if worker is not None else None


@pytest.fixture
async def plane() -> AsyncIterator[FakePlane]:
    config = fake_config(**{"workers.prefill": 1, "workers.decode": 1})
    specs = worker_specs(config, FakeEngineFactory(), ConnectorFactory(config.kvtransfer))
    workers = {s.worker_id: Worker(s) for s in specs}
    yield FakePlane(workers)
    for w in workers.values():
        w.stop_now()


def _gateway(
    plane: FakePlane, find_plane: Callable[[], Any | None] = lambda: None
) -> GatewayService:
    config = fake_config()
    settings = GatewaySettings(
        config.gateway, config.router, config.model, config.kvtransfer.backend
    )
    return GatewayService(
        settings,
        FakeTokenizer(),
        (),
        _launch_nothing,
        remote_controller=lambda on_snapshot, on_down, on_up: RemoteController(
            plane,
            lambda entry: _current(plane, find_plane).find(entry),
            on_snapshot=on_snapshot,
            on_worker_down=on_down,
            on_worker_up=on_up,
            find_plane=find_plane,
            poll_interval_s=0.02,
        ),
    )


def _current(plane: FakePlane, find_plane: Callable[[], Any | None]) -> FakePlane:
    """The plane ``baton-controller`` names now: a new one once started, else ``plane``."""
    try:
        found = find_plane()
    except RuntimeError:
        found = None
    return found if isinstance(found, FakePlane) else plane


def _launch_nothing(spec: Any) -> Any:
    raise AssertionError("a gateway over a control plane launches nothing")


async def _complete(svc: GatewayService) -> str:
    app = create_app(svc, manage_lifecycle=False)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])


async def test_two_gateways_share_the_workers_and_one_stopping_leaves_them_serving(
    plane: FakePlane,
) -> None:
    first, second = _gateway(plane), _gateway(plane)
    await first.start()
    await second.start()
    try:
        assert first.is_ready() and second.is_ready()
        assert set(first.router.reports()) == set(second.router.reports()) == set(plane.workers)
        text = await _complete(first)
        assert await _complete(second) == text
        await first.stop()
        assert all([await w.ping() for w in plane.workers.values()])  # still running
        assert await _complete(second) == text
        snapshots = [await w.snapshot() for w in plane.workers.values()]
        finished = sum(s.num_finished_requests for s in snapshots)
        assert finished >= 3  # the requests of both gateways ran on the same workers
    finally:
        await second.stop()


async def test_a_worker_leaving_the_registry_is_down_for_the_gateway(plane: FakePlane) -> None:
    svc = _gateway(plane)
    await svc.start()
    try:
        gone = plane.workers.pop("decode-0")
        for _ in range(100):
            if "decode-0" not in svc.controller.workers():
                break
            await _sleep(0.02)
        assert "decode-0" not in svc.controller.workers()
        assert "decode-0" not in svc.router.reports()
        assert plane.reported_dead == []  # the plane knew first; nothing to report
        gone.stop_now()
    finally:
        await svc.stop()


async def test_a_dead_worker_seen_by_the_gateway_is_reported_to_the_plane(
    plane: FakePlane,
) -> None:
    svc = _gateway(plane)
    await svc.start()
    try:
        svc.controller.report_dead("prefill-0")
        await _sleep(0)
        assert plane.reported_dead == ["prefill-0"]
        assert "prefill-0" not in svc.router.reports()
        await _sleep(0.1)  # still listed by the plane: not adopted again by this gateway
        assert "prefill-0" not in svc.controller.workers()
    finally:
        await svc.stop()


async def test_a_flip_through_the_plane_returns_the_role_the_worker_has_after(
    plane: FakePlane,
) -> None:
    """The rebalancer counts a flip only if the worker took the role: through a control
    plane too, ``set_role`` answers with the role after."""
    svc = _gateway(plane)
    await svc.start()
    try:
        assert await svc.controller.set_role("decode-0", Role.MIXED) is Role.MIXED
        plane.workers["prefill-0"]._fixed_role = True  # as an encoder beside vLLM
        assert await svc.controller.set_role("prefill-0", Role.DECODE) is Role.PREFILL
    finally:
        await svc.stop()


async def test_worker_generations_are_read_from_their_ids() -> None:
    assert _base_id("decode-1.r3") == "decode-1" and _generation("decode-1.r3") == 3
    assert _base_id("decode-1") == "decode-1" and _generation("decode-1") == 0
    assert max(["prefill-0", "prefill-0.r2", "prefill-0.r10"], key=_generation) == "prefill-0.r10"


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def test_a_controller_adopting_workers_never_reuses_a_worker_id() -> None:
    from services.cluster.controller import Controller
    from services.cluster.launchers import launch_in_process

    config = fake_config(**{"workers.prefill": 1, "workers.decode": 1})
    specs = worker_specs(config, FakeEngineFactory(), ConnectorFactory(config.kvtransfer))
    adopted = [replace(specs[0], worker_id="prefill-0.r2"), specs[1]]
    downs: list[str] = []
    controller = Controller(
        adopted,
        launch_in_process,
        on_snapshot=lambda s: None,
        on_worker_down=lambda wid, role: downs.append(wid),
    )
    await controller.start()
    try:
        controller.report_dead("prefill-0.r2")
        controller.report_dead("decode-0")
        assert set(controller.workers()) == {"prefill-0.r3", "decode-0.r1"}
    finally:
        await controller.stop()


async def test_a_restarting_controller_does_not_take_the_workers_from_the_gateway(
    plane: FakePlane,
) -> None:
    from services.cluster.control_plane import ControllerStartingError

    svc = _gateway(plane)
    await svc.start()
    try:

        async def starting() -> Registry:
            raise ControllerStartingError("adopting")

        plane.registry = _FakeMethod(starting)  # Ray restarted the controller
        await _sleep(0.2)  # several polls
        assert set(svc.controller.workers()) == set(plane.workers)
        assert set(svc.router.reports()) == set(plane.workers)
        assert await _complete(svc)
    finally:
        await svc.stop()


async def test_the_registry_of_a_controller_not_started_yet_is_unknown_not_empty() -> None:
    from services.cluster.control_plane import ControllerStartingError, ControlPlane

    config = fake_config()
    cp = ControlPlane(config, specs=[])
    adopting = asyncio.Event()

    async def still_adopting() -> None:
        await adopting.wait()

    cp._start = still_adopting  # type: ignore[method-assign]  # Ray restarted it: adopting
    with pytest.raises(ControllerStartingError):
        await cp.registry()
    adopting.set()


class FakeActorDiedError(Exception):
    """Ray's ActorDiedError's place: the controller actor was killed (``cluster down``)."""


async def test_a_control_plane_started_anew_is_adopted_with_workers_under_the_old_ids(
    plane: FakePlane, caplog: pytest.LogCaptureFixture
) -> None:
    """``baton cluster down`` then ``up`` while a gateway serves: the gateway refuses with
    a 503 that says no worker is up, warns once (not once a poll), and serves again on
    the new plane's workers, whose ids are the old ones, without a restart."""
    named: list[FakePlane] = []

    def find_plane() -> FakePlane:
        if not named:  # the lookup failing must not end the polling
            raise RuntimeError("Ray's store does not answer either")
        return named[0]

    svc = _gateway(plane, find_plane)
    await svc.start()
    try:
        text = await _complete(svc)

        async def died() -> Registry:
            raise FakeActorDiedError("the actor died")

        plane.registry = _FakeMethod(died)  # cluster down: the controller, then its workers
        for worker_id, worker in plane.workers.items():
            worker.stop_now()
            svc.controller.report_dead(worker_id)  # as a stream to it that failed does
        assert not svc.router.reports()
        app = create_app(svc, manage_lifecycle=False)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8}
            r = await client.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert "no worker is up" in r.json()["error"]["message"]
        await _sleep(0.2)  # ten polls that fail
        lost = [r for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(lost) == 1, [r.getMessage() for r in lost]

        config = fake_config(**{"workers.prefill": 1, "workers.decode": 1})
        specs = worker_specs(config, FakeEngineFactory(), ConnectorFactory(config.kvtransfer))
        anew = FakePlane({s.worker_id: Worker(s) for s in specs})  # cluster up: same ids
        named.append(anew)
        try:
            for _ in range(200):
                if svc.is_ready():
                    break
                await _sleep(0.02)
            assert set(svc.router.reports()) == {"prefill-0", "decode-0"}
            assert await _complete(svc) == text
            snapshots = [await w.snapshot() for w in anew.workers.values()]
            assert sum(s.num_finished_requests for s in snapshots) >= 1  # the new workers
        finally:
            for w in anew.workers.values():
                w.stop_now()
    finally:
        await svc.stop()
