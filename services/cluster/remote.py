"""A gateway's view of a control plane that runs elsewhere (``baton gateway --ray-address``).

    start()        find ``baton-controller``, wait until its workers are ready, then
                   keep its registry (polled) and one telemetry watch per worker
    watch          ``on_worker_up`` as a watch starts; every snapshot goes to
                   ``on_snapshot`` (this gateway's Router); a watch that ends, or a
                   worker leaving the registry, is ``on_worker_down``
    report_dead    a stream saw the worker die: forget it here, tell the controller
    stop()         end the watches; the workers and the controller keep running

While the controller cannot be reached the gateway serves with the workers it watches,
warns once (and once a minute after), and looks the controller up by name again: a
controller that Ray restarts is the same actor, but one started anew after ``baton
cluster down`` and ``up`` is another, whose workers may reuse the old ids. Its registry
is then the truth: the ids seen dead here are forgotten, and its workers adopted.

Same surface as ``Controller`` for ``GatewayService`` (client, workers, is_ready,
report_dead, set_role), but it launches and kills nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.types import Role
from services.cluster.control_plane import Registry, WorkerEntry
from services.workers.client import WorkerClient, WorkerDiedError
from services.workers.messages import WorkerSnapshot

__all__ = ["RemoteController", "find_ray_worker_of"]

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0  # while the control plane does not answer


@dataclass(slots=True)
class _Watched:
    entry: WorkerEntry
    client: WorkerClient
    ready: asyncio.Event
    watch: asyncio.Task[None] | None = None


class RemoteController:
    def __init__(
        self,
        plane: Any,
        find_worker: Callable[[WorkerEntry], WorkerClient | None],
        *,
        on_snapshot: Callable[[WorkerSnapshot], None],
        on_worker_down: Callable[[str, Role], None],
        on_worker_up: Callable[[str], None] = lambda worker_id: None,
        find_plane: Callable[[], Any | None] = lambda: None,
        poll_interval_s: float = 0.25,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self._plane = plane
        self._find_worker = find_worker
        self._find_plane = find_plane
        self._on_snapshot = on_snapshot
        self._on_worker_down = on_worker_down
        self._on_worker_up = on_worker_up
        self._poll_interval_s = poll_interval_s
        self._ready_timeout_s = ready_timeout_s
        self._watched: dict[str, _Watched] = {}
        # Ids seen dead here, not adopted again while the registry still lists them (the
        # controller hears of the death after us); forgotten once the registry drops them.
        self._gone: set[str] = set()
        self._poll_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        registry: Registry = await asyncio.wait_for(
            self._plane.start.remote(), self._ready_timeout_s
        )
        self._sync(registry)
        await asyncio.wait_for(
            asyncio.gather(*(w.ready.wait() for w in self._watched.values())),
            self._ready_timeout_s,
        )
        self._poll_task = asyncio.create_task(self._poll_forever(), name="registry-poll")

    async def stop(self) -> None:
        tasks = [w.watch for w in self._watched.values() if w.watch is not None]
        if self._poll_task is not None:
            tasks.append(self._poll_task)
        for task in tasks:
            task.cancel()
        self._watched.clear()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the Controller surface ------------------------------------------------------------
    def client(self, worker_id: str) -> WorkerClient | None:
        watched = self._watched.get(worker_id)
        return watched.client if watched is not None else None

    def workers(self) -> dict[str, Role]:
        return {wid: w.entry.role for wid, w in self._watched.items()}

    def is_ready(self) -> bool:
        return bool(self._watched) and all(w.ready.is_set() for w in self._watched.values())

    def report_dead(self, worker_id: str) -> None:
        if self._down(worker_id, "reported dead"):
            self._plane.report_dead.remote(worker_id)

    async def set_role(self, worker_id: str, role: Role) -> Role:
        """The worker's role after (its own, if it keeps it)."""
        now: Role = await self._plane.set_role.remote(worker_id, role)
        return now

    # -- internals ------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        lost_s: float | None = None  # since when the controller has not answered
        warned_s = 0.0
        while True:
            await asyncio.sleep(self._poll_interval_s)
            try:
                registry: Registry = await self._plane.registry.remote()
            except Exception as e:  # restarting, or gone: keep serving what we have
                now = loop.time()
                if lost_s is None or now - warned_s >= _WARN_EVERY_S:
                    since = "" if lost_s is None else f" for {now - lost_s:.0f} s"
                    log.warning(
                        "the control plane does not answer%s (%s); serving with the %d "
                        "workers this gateway watches, and looking it up again",
                        since,
                        type(e).__name__,
                        len(self._watched),
                    )
                    lost_s = now if lost_s is None else lost_s
                    warned_s = now
                await self._look_up_plane()
                continue
            if lost_s is not None:
                log.info("the control plane answers again after %.1f s", loop.time() - lost_s)
                lost_s = None
            self._sync(registry)

    async def _look_up_plane(self) -> None:
        """The controller by name: another actor than ours (started anew) takes over."""
        try:
            plane = await asyncio.to_thread(self._find_plane)
        except Exception as e:  # Ray's own store unreachable too: the next poll asks again
            log.debug("looking up the control plane failed: %s", e)
            return
        if plane is None or plane == self._plane:
            return
        log.info("a new control plane: adopting the workers its registry lists")
        self._plane = plane
        self._gone.clear()

    def _sync(self, registry: Registry) -> None:
        listed = {e.worker_id: e for e in registry.workers}
        self._gone &= set(listed)
        for worker_id in set(self._watched) - set(listed):
            self._down(worker_id, "left the controller's registry")
        for worker_id, entry in listed.items():
            if worker_id in self._gone:
                continue
            watched = self._watched.get(worker_id)
            if watched is None:
                self._watch(entry)
            else:
                watched.entry = entry  # a role flip

    def _watch(self, entry: WorkerEntry) -> None:
        client = self._find_worker(entry)
        if client is None:
            return  # gone between the registry and now; the next poll tells
        watched = _Watched(entry, client, asyncio.Event())
        self._watched[entry.worker_id] = watched
        self._on_worker_up(entry.worker_id)
        watched.watch = asyncio.create_task(
            self._telemetry(watched), name=f"watch-{entry.worker_id}"
        )

    async def _telemetry(self, watched: _Watched) -> None:
        reason = "telemetry stream ended"
        try:
            async for snapshot in watched.client.telemetry():
                watched.ready.set()
                self._on_snapshot(snapshot)
        except WorkerDiedError as e:
            reason = str(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if self._down(watched.entry.worker_id, reason):
            self._plane.report_dead.remote(watched.entry.worker_id)

    def _down(self, worker_id: str, reason: str) -> bool:
        watched = self._watched.pop(worker_id, None)
        if watched is None:
            return False
        self._gone.add(worker_id)
        log.warning("worker %s is down for this gateway (%s)", worker_id, reason)
        if watched.watch is not None and watched.watch is not asyncio.current_task():
            watched.watch.cancel()
        self._on_worker_down(worker_id, watched.entry.role)
        return True


def find_ray_worker_of(namespace: str) -> Callable[[WorkerEntry], WorkerClient | None]:
    """Look a registry entry's worker actor up by its name, in ``namespace``."""

    def find(entry: WorkerEntry) -> WorkerClient | None:
        from services.workers.actor import find_ray_worker

        return find_ray_worker(entry.worker_id, entry.actor_name, namespace)

    return find
