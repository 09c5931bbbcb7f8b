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

__all__ = ["launch_ray_worker"]

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
) -> RayWorkerClient:
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "max_concurrency": _MAX_CONCURRENT_CALLS,
        "max_restarts": 0,
    }
    if runtime_env:
        options["runtime_env"] = runtime_env
    role_resource = str(spec.role.value)
    if role_resource in _cluster_resource_names():
        options["resources"] = {role_resource: 1}
    actor = _actor_class().options(**options).remote(spec)
    return RayWorkerClient(spec.worker_id, actor)
