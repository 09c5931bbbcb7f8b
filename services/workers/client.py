"""Worker handles as the gateway and the controller see them.

``WorkerClient`` is the seam: the same calls whether the worker is a Ray actor
(``RayWorkerClient``) or an object in this process (``InProcessWorkerClient``,
used by unit tests and the in-process benchmark). A worker that died surfaces
as ``WorkerDiedError`` from any of the async calls or streams, whatever the
transport.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from router.types import Role
from services.workers.messages import Job, RequestFailed, TokenDelta, WorkerEvent, WorkerSnapshot
from services.workers.worker import Worker

__all__ = ["InProcessWorkerClient", "RayWorkerClient", "WorkerClient", "WorkerDiedError"]


class WorkerDiedError(RuntimeError):
    def __init__(self, worker_id: str, cause: str = "") -> None:
        super().__init__(f"worker {worker_id} died" + (f": {cause}" if cause else ""))
        self.worker_id = worker_id


class WorkerClient(Protocol):
    worker_id: str

    def generate(self, job: Job) -> AsyncIterator[WorkerEvent]: ...

    def abort(self, request_id: str) -> None:
        """Fire and forget; safe inside a cancelled coroutine's ``finally``."""
        ...

    def telemetry(self) -> AsyncIterator[WorkerSnapshot]: ...

    async def snapshot(self) -> WorkerSnapshot: ...

    async def ping(self) -> str: ...

    async def set_role(self, role: Role) -> Role: ...

    async def shutdown(self) -> None: ...

    def kill(self) -> None:
        """Stop the worker without asking it (it may be hung or gone)."""
        ...


class InProcessWorkerClient:
    def __init__(self, worker: Worker) -> None:
        self.worker_id = worker.worker_id
        self.worker = worker

    def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        return self.worker.generate(job)

    def abort(self, request_id: str) -> None:
        self.worker.abort_soon(request_id)

    def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        return self.worker.telemetry()

    async def snapshot(self) -> WorkerSnapshot:
        return await self.worker.snapshot()

    async def ping(self) -> str:
        return await self.worker.ping()

    async def set_role(self, role: Role) -> Role:
        return await self.worker.set_role(role)

    async def shutdown(self) -> None:
        await self.worker.shutdown()

    def kill(self) -> None:
        self.worker.stop_now()


def _is_final(event: WorkerEvent) -> bool:
    return isinstance(event, RequestFailed) or (
        isinstance(event, TokenDelta) and event.finish_reason is not None
    )


# A worker's stream waits once this many events are unread. This is how a worker learns
# that a gateway process died: the wait fails, the worker's generator is closed, and its
# ``finally`` aborts the request and frees its blocks (without a bound, Ray would keep
# the generator running for a consumer that is gone). Nothing is lost while it waits:
# the worker coalesces queued token events into one.
_UNREAD_EVENTS = 8


class RayWorkerClient:
    """Calls a ``Worker`` Ray actor; token events arrive through a streaming generator."""

    def __init__(self, worker_id: str, actor: Any) -> None:
        self.worker_id = worker_id
        self.actor = actor

    async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        import ray

        stream = self.actor.generate.options(
            num_returns="streaming", _generator_backpressure_num_objects=_UNREAD_EVENTS
        ).remote(job)
        finished = False
        try:
            async for ref in stream:
                event: WorkerEvent = await ref
                finished = _is_final(event)
                yield event
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.worker_id, type(e).__name__) from e
        finally:
            if not finished:
                self.abort(job.request.request_id)
                with contextlib.suppress(Exception):
                    ray.cancel(stream)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)

    async def telemetry(self) -> AsyncIterator[WorkerSnapshot]:
        import ray

        stream = self.actor.telemetry.options(
            num_returns="streaming", _generator_backpressure_num_objects=_UNREAD_EVENTS
        ).remote()
        try:
            async for ref in stream:
                yield await ref
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.worker_id, type(e).__name__) from e
        finally:
            with contextlib.suppress(Exception):
                ray.cancel(stream)

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(self.worker_id, type(e).__name__) from e

    async def snapshot(self) -> WorkerSnapshot:
        result: WorkerSnapshot = await self._call("snapshot")
        return result

    async def ping(self) -> str:
        result: str = await self._call("ping")
        return result

    async def set_role(self, role: Role) -> Role:
        result: Role = await self._call("set_role", role)
        return result

    async def shutdown(self) -> None:
        await self._call("shutdown")

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
