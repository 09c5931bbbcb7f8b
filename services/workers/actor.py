"""Launching a ``Worker`` as a Ray actor.

The actor is async (its methods run on one event loop; the engine runs in the
worker's own loop thread), asks Ray for a GPU on CUDA machines and for a small,
configurable share of CPU otherwise.
"""

from __future__ import annotations

import functools
from typing import Any

from services.workers.client import RayWorkerClient
from services.workers.worker import Worker, WorkerSpec

__all__ = ["launch_ray_worker"]

_MAX_CONCURRENT_CALLS = 4096  # streams + telemetry + control calls in flight at once


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
    actor = _actor_class().options(**options).remote(spec)
    return RayWorkerClient(spec.worker_id, actor)
