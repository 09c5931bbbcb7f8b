"""Ways to start a worker: as a Ray actor (serving) or as an object in this process (tests)."""

from __future__ import annotations

from dataclasses import dataclass

from services.workers.client import InProcessWorkerClient, WorkerClient
from services.workers.worker import Worker, WorkerSpec

__all__ = ["RayLauncher", "launch_in_process"]


def launch_in_process(spec: WorkerSpec) -> WorkerClient:
    return InProcessWorkerClient(Worker(spec))


@dataclass(frozen=True, slots=True)
class RayLauncher:
    num_cpus: float
    num_gpus: float

    def __call__(self, spec: WorkerSpec) -> WorkerClient:
        from services.workers.actor import launch_ray_worker

        num_gpus = self.num_gpus if spec.num_gpus is None else spec.num_gpus
        return launch_ray_worker(spec, num_cpus=self.num_cpus, num_gpus=num_gpus)
