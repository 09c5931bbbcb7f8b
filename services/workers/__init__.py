"""Workers: one Ray actor class whose role (prefill, decode, mixed) is a run-time mode."""

from services.workers.client import (
    InProcessWorkerClient,
    RayWorkerClient,
    WorkerClient,
    WorkerDiedError,
)
from services.workers.messages import (
    Continue,
    FailureKind,
    Generate,
    KVPulled,
    RequestFailed,
    TokenDelta,
    WorkerSnapshot,
)
from services.workers.worker import Worker, WorkerSpec

__all__ = [
    "Continue",
    "FailureKind",
    "Generate",
    "InProcessWorkerClient",
    "KVPulled",
    "RayWorkerClient",
    "RequestFailed",
    "TokenDelta",
    "Worker",
    "WorkerClient",
    "WorkerDiedError",
    "WorkerSnapshot",
    "WorkerSpec",
]
