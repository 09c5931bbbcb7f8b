"""Launching a ``Worker`` as a Ray actor.

The actor is async (its methods run on one event loop; the engine runs in the
worker's own loop thread), asks Ray for a GPU on CUDA machines and for a small,
configurable share of CPU otherwise. On a cluster whose nodes advertise a
custom resource named after a role (the Helm chart's worker groups offer
``{"prefill": N}``, ``{"decode": N}``...), the actor also asks for one unit of
its role's resource so it lands on a pod of that group; on a laptop, where no
node offers it, placement is unconstrained.
"""

from __future__ import annotations

import functools
from typing import Any

from services.workers.client import RayWorkerClient
from services.workers.worker import Worker, WorkerSpec

__all__ = ["find_ray_worker", "launch_ray_worker"]

_MAX_CONCURRENT_CALLS = 4096  # streams + telemetry + control calls in flight at once


def _cluster_resource_names() -> set[str]:
    import ray

    return set(ray.cluster_resources())


@functools.cache
def _actor_class() -> Any:
    import ray

    return ray.remote(Worker)


def launch_ray_worker(
    spec: WorkerSpec,
    *,
    num_cpus: float,
    num_gpus: float,
    runtime_env: dict[str, Any] | None = None,
    name: str | None = None,
    namespace: str | None = None,
) -> RayWorkerClient:
    """``name``: a named, detached actor, found again by ``find_ray_worker`` from any
    process of the Ray cluster and outliving the process that launched it."""
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_concurrency": _MAX_CONCURRENT_CALLS,
        "max_restarts": 0,
    }
    if runtime_env:
        options["runtime_env"] = runtime_env
    if name is not None:
        options.update(name=name, namespace=namespace, lifetime="detached")
    role_resource = str(spec.role.value)
    if role_resource in _cluster_resource_names():
        options["resources"] = {role_resource: 1}
    actor = _actor_class().options(**options).remote(spec)
    return RayWorkerClient(spec.worker_id, actor)


def find_ray_worker(worker_id: str, name: str, namespace: str | None) -> RayWorkerClient | None:
    """The live named worker actor ``name``, or None."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:  # no such actor (never started, or killed)
        return None
    return RayWorkerClient(worker_id, actor)
