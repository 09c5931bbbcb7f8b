"""The control plane as Ray actors that outlive any gateway.

    baton cluster up       start_control_plane(): the named, detached actor
                           ``baton-controller`` runs a ``Controller`` whose workers are
                           named, detached actors ``baton-worker-<worker id>``
    baton gateway          ``RemoteController`` (remote.py) finds the controller by
                           name, reads its ``Registry`` and subscribes to every
                           worker's telemetry itself; any number of gateways at once
    a gateway dies         the controller and the workers do not notice; the workers
                           free the dead gateway's streams (their consumer is gone)
    the controller dies    Ray restarts it (``max_restarts=-1``); it finds its workers
                           again by name (the newest generation of each) and launches
                           only the missing ones
    baton cluster down     ``shutdown``: stop every worker, then the controller

Who owns what: the controller owns the workers' lives (launch, health, replace,
role); each gateway owns only its own requests and its own ``Router``. Two gateways
may reserve the same room at once; the engines' own admission stays the safety net.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from router.types import Role
from services.cluster.controller import Controller, ControllerConfig
from services.config import ClusterConfig
from services.workers.client import WorkerClient
from services.workers.messages import WorkerSnapshot
from services.workers.worker import WorkerSpec

__all__ = [
    "CONTROLLER_NAME",
    "CONTROLLER_RESOURCE",
    "NAMESPACE",
    "ControlPlane",
    "ControllerStartingError",
    "Registry",
    "WorkerEntry",
    "find_control_plane",
    "start_control_plane",
    "worker_actor_name",
]

NAMESPACE = "baton"
CONTROLLER_NAME = "baton-controller"
# A Ray resource only the node meant for the controller offers (the chart's head), so the
# controller never lands on a gateway's or a worker's node.
CONTROLLER_RESOURCE = "baton_controller"
_WORKER_PREFIX = "baton-worker-"
_GENERATION = re.compile(r"^(?P<base>.+?)(?:\.r(?P<gen>\d+))?$")


def worker_actor_name(worker_id: str) -> str:
    return _WORKER_PREFIX + worker_id


class ControllerStartingError(RuntimeError):
    """The registry is not known yet (the controller is starting, or adopting after a restart)."""


@dataclass(frozen=True, slots=True)
class WorkerEntry:
    worker_id: str
    role: Role
    actor_name: str


@dataclass(frozen=True, slots=True)
class Registry:
    """The controller's workers now; ``ready``: each has sent telemetry since it started."""

    workers: tuple[WorkerEntry, ...]
    ready: bool


@dataclass(frozen=True, slots=True)
class _NamedLauncher:
    """Launch a worker as a named, detached actor, or adopt the live one of that name."""

    num_cpus: float
    num_gpus: float
    namespace: str

    def __call__(self, spec: WorkerSpec) -> WorkerClient:
        from services.workers.actor import find_ray_worker, launch_ray_worker

        name = worker_actor_name(spec.worker_id)
        found = find_ray_worker(spec.worker_id, name, self.namespace)
        if found is not None:
            return found
        num_gpus = self.num_gpus if spec.num_gpus is None else spec.num_gpus
        return launch_ray_worker(
            spec, num_cpus=self.num_cpus, num_gpus=num_gpus, name=name, namespace=self.namespace
        )


class ControlPlane:
    """The body of the ``baton-controller`` actor (``ray.remote`` is applied at launch).

    It keeps the ``ClusterConfig`` it was started with, so a gateway needs only the Ray
    address: ``cluster_config()`` gives it the model, router and gateway sections."""

    def __init__(
        self,
        cluster: ClusterConfig,
        specs: Sequence[WorkerSpec] | None = None,
        namespace: str = NAMESPACE,
        config: ControllerConfig | None = None,
    ) -> None:
        self._cluster = cluster
        self._specs = list(specs) if specs is not None else _specs(cluster)
        self._launcher = _NamedLauncher(cluster.workers.num_cpus, 0.0, namespace)
        self._namespace = namespace
        self._config = config
        self._controller: Controller | None = None
        self._starting: asyncio.Task[None] | None = None

    async def start(self) -> Registry:
        """Launch (or adopt) every worker; returns once each has sent telemetry. Idempotent."""
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._starting)
        return await self.registry()

    async def _start(self) -> None:
        specs = await self._adopt(self._specs)
        self._controller = Controller(
            specs,
            self._launcher,
            on_snapshot=_ignore_snapshot,
            on_worker_down=_ignore_down,
            config=self._config,
        )
        await self._controller.start()

    async def _adopt(self, specs: Sequence[WorkerSpec]) -> list[WorkerSpec]:
        """Each spec as its newest live actor (after a restart of this controller): the
        worker id of the newest generation, and the role the worker has now."""
        from ray.util import list_named_actors

        live = {
            entry["name"]
            for entry in list_named_actors(all_namespaces=True)
            if entry.get("namespace") == self._namespace
        }
        adopted = []
        for spec in specs:
            base = _base_id(spec.worker_id)
            ids = [
                name.removeprefix(_WORKER_PREFIX)
                for name in live
                if name.startswith(_WORKER_PREFIX)
                and _base_id(name.removeprefix(_WORKER_PREFIX)) == base
            ]
            if not ids:
                adopted.append(spec)
                continue
            newest = max(ids, key=_generation)
            client = self._launcher(replace(spec, worker_id=newest))
            try:
                role = await asyncio.wait_for(_role_of(client), 10.0)
            except Exception:  # the actor is there but not answering: the controller decides
                role = spec.role
            adopted.append(replace(spec, worker_id=newest, role=role))
        return adopted

    async def registry(self) -> Registry:
        if self._starting is None:  # restarted by Ray: the first caller starts it again
            self._starting = asyncio.get_running_loop().create_task(self._start())
        c = self._controller
        if c is None:
            # Not "no workers": gateways would drop every worker they serve with.
            raise ControllerStartingError("the controller is adopting its workers")
        entries = tuple(
            WorkerEntry(wid, role, worker_actor_name(wid)) for wid, role in c.workers().items()
        )
        return Registry(entries, c.is_ready())

    async def report_dead(self, worker_id: str) -> None:
        if self._controller is not None:
            self._controller.report_dead(worker_id)

    async def set_role(self, worker_id: str, role: Role) -> Role | None:
        """The worker's role after (its own, if it keeps it); None: no controller here."""
        if self._controller is None:
            return None
        return await self._controller.set_role(worker_id, role)

    async def shutdown(self) -> None:
        """Stop and kill every worker (``baton cluster down``)."""
        if self._controller is not None:
            await self._controller.stop()

    async def ping(self) -> str:
        return CONTROLLER_NAME

    async def cluster_config(self) -> ClusterConfig:
        return self._cluster


def _specs(cluster: ClusterConfig) -> list[WorkerSpec]:
    import ray

    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    return worker_specs(cluster, *factories_for(cluster), cluster_has_gpus=has_gpus)


async def _role_of(client: WorkerClient) -> Role:
    role: Role = await client.actor.role.remote()  # type: ignore[attr-defined]
    return role


def _base_id(worker_id: str) -> str:
    match = _GENERATION.match(worker_id)
    return match.group("base") if match else worker_id


def _generation(worker_id: str) -> int:
    match = _GENERATION.match(worker_id)
    return int(match.group("gen") or 0) if match else 0


def _ignore_snapshot(snapshot: WorkerSnapshot) -> None:
    del snapshot  # the controller watches telemetry for liveness only; gateways route


def _ignore_down(worker_id: str, role: Role) -> None:
    del worker_id, role  # gateways see it in the registry and in their own watches


def start_control_plane(
    cluster: ClusterConfig,
    *,
    specs: Sequence[WorkerSpec] | None = None,
    namespace: str = NAMESPACE,
    config: ControllerConfig | None = None,
) -> Any:
    """The ``baton-controller`` actor (started unless it runs already). Call ``start``
    on the handle to launch the workers and wait for them."""
    import ray

    existing = find_control_plane(namespace)
    if existing is not None:
        return existing
    options: dict[str, Any] = {
        "name": CONTROLLER_NAME,
        "namespace": namespace,
        "lifetime": "detached",
        "max_restarts": -1,
        "max_concurrency": 1024,
        "num_cpus": 0,
    }
    if CONTROLLER_RESOURCE in ray.cluster_resources():  # the Helm chart's head offers it
        options["resources"] = {CONTROLLER_RESOURCE: 1}
    actor_class = ray.remote(ControlPlane)
    return actor_class.options(**options).remote(
        cluster, None if specs is None else list(specs), namespace, config
    )


def find_control_plane(namespace: str = NAMESPACE) -> Any | None:
    import ray

    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None
