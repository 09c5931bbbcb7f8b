"""The controller: launches workers, keeps the registry, watches health, replaces the dead.

    start()       launch every spec; ready once each worker has sent a snapshot
    watch         one telemetry subscription per worker feeds ``on_snapshot``;
                  the stream raising WorkerDiedError means the worker is gone
    ping          every ``ping_interval_s`` each ready worker must answer within
                  ``ping_timeout_s`` (a hung engine loop, a lost node)
    down          remove from the registry, tell ``on_worker_down``, kill what
                  is left of it, launch a replacement with the same role: at once
                  the first time, then with a doubling backoff while the same
                  slot keeps crashing (``restart_backoff_s`` .. ``max_restart_backoff_s``)
    readiness     every worker slot as ready, starting or down (``/ready``)
    set_role      drain a worker and switch its role (the P/D planner's lever)

A worker that died is noticed within about a second either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from router.types import Role
from services.workers.client import WorkerClient, WorkerDiedError
from services.workers.messages import WorkerSnapshot
from services.workers.worker import WorkerSpec

__all__ = ["Controller", "ControllerConfig", "Launcher", "WorkerReadiness"]

log = logging.getLogger(__name__)

Launcher = Callable[[WorkerSpec], WorkerClient]


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    ping_interval_s: float = 0.5
    ping_timeout_s: float = 1.0
    # Consecutive missed pings before a live actor counts as hung: a worker whose
    # engine step briefly holds its process (a long prefill on a busy CPU) is not
    # killed for one slow answer. A dead actor is noticed at once by its watch.
    ping_misses_to_down: int = 3
    replace_dead: bool = True
    ready_timeout_s: float = 300.0
    # A slot whose worker crashes again within crash_window_s of its last crash is
    # restarted after restart_backoff_s, doubled per crash, at most max_restart_backoff_s.
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0
    crash_window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class WorkerReadiness:
    """One worker slot as ``/ready`` reports it."""

    worker_id: str
    role: Role
    state: Literal["ready", "starting", "down"]
    reason: str | None = None  # why it went down
    since_s: float = 0.0  # wall-clock time of the last change


@dataclass(slots=True)
class _Crashes:
    """A slot's recent crashes: how many in a row (within the window), the last one."""

    count: int = 0
    last_s: float = field(default=-float("inf"))


@dataclass(slots=True)
class _Entry:
    spec: WorkerSpec
    client: WorkerClient
    ready: asyncio.Event
    watch: asyncio.Task[None] | None = None
    missed_pings: int = 0
    since_s: float = field(default_factory=time.time)


class Controller:
    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        launch: Launcher,
        *,
        on_snapshot: Callable[[WorkerSnapshot], None],
        on_worker_down: Callable[[str, Role], None],
        config: ControllerConfig | None = None,
    ) -> None:
        self._specs = list(specs)
        self._launch = launch
        self._on_snapshot = on_snapshot
        self._on_worker_down = on_worker_down
        self._config = config or ControllerConfig()
        self._entries: dict[str, _Entry] = {}
        # Successors count on from the generation in a spec's id ("decode-0.r2" -> ".r3"), so
        # a controller that adopts running workers never reuses a worker id.
        self._generation: dict[str, int] = {
            spec.worker_id.split(".r")[0]: int(spec.worker_id.split(".r")[1])
            for spec in specs
            if ".r" in spec.worker_id and spec.worker_id.split(".r")[1].isdigit()
        }
        self._crashes: dict[str, _Crashes] = {}  # slot (base worker id) -> crashes
        self._down_slots: dict[str, WorkerReadiness] = {}  # slot -> until its successor is up
        self._restarts: list[asyncio.TimerHandle] = []
        self._ping_task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        for spec in self._specs:
            self._start_worker(spec)
        await asyncio.wait_for(
            asyncio.gather(*(e.ready.wait() for e in self._entries.values())),
            self._config.ready_timeout_s,
        )
        self._ping_task = asyncio.create_task(self._ping_forever(), name="controller-ping")

    async def stop(self) -> None:
        self._stopping = True
        tasks = [e.watch for e in self._entries.values() if e.watch is not None]
        if self._ping_task is not None:
            tasks.append(self._ping_task)
        for task in tasks:
            task.cancel()
        for restart in self._restarts:
            restart.cancel()
        for entry in list(self._entries.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(entry.client.shutdown(), 5.0)
            entry.client.kill()
        self._entries.clear()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- registry ------------------------------------------------------------------------
    def client(self, worker_id: str) -> WorkerClient | None:
        entry = self._entries.get(worker_id)
        return entry.client if entry is not None else None

    def workers(self) -> dict[str, Role]:
        return {wid: e.spec.role for wid, e in self._entries.items()}

    def is_ready(self) -> bool:
        return bool(self._entries) and all(e.ready.is_set() for e in self._entries.values())

    def readiness(self) -> list[WorkerReadiness]:
        """Every slot: its live worker (ready or starting) or, until a successor is up,
        the worker that went down and why."""
        out = [
            WorkerReadiness(
                wid, e.spec.role, "ready" if e.ready.is_set() else "starting", None, e.since_s
            )
            for wid, e in self._entries.items()
        ]
        up = {_slot(w.worker_id) for w in out if w.state == "ready"}
        out += [d for slot, d in self._down_slots.items() if slot not in up]
        return sorted(out, key=lambda w: w.worker_id)

    def report_dead(self, worker_id: str) -> None:
        """Someone saw the worker die (a stream raised WorkerDiedError)."""
        self._down(worker_id, "reported dead")

    async def set_role(self, worker_id: str, role: Role) -> Role:
        """The worker's role after: ``role``, or its own if it keeps it (``fixed_role``)."""
        entry = self._entries[worker_id]
        now = await entry.client.set_role(role)
        entry.spec = replace(entry.spec, role=now)
        return now

    # -- internals ------------------------------------------------------------------------
    def _start_worker(self, spec: WorkerSpec) -> None:
        client = self._launch(spec)
        entry = _Entry(spec, client, asyncio.Event())
        self._entries[spec.worker_id] = entry
        entry.watch = asyncio.create_task(self._watch(entry), name=f"watch-{spec.worker_id}")

    async def _watch(self, entry: _Entry) -> None:
        worker_id = entry.spec.worker_id
        reason = "telemetry stream ended"
        try:
            async for snapshot in entry.client.telemetry():
                if not entry.ready.is_set():
                    entry.ready.set()
                    entry.since_s = time.time()
                    self._down_slots.pop(_slot(worker_id), None)
                self._on_snapshot(snapshot)
        except WorkerDiedError as e:
            reason = str(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a worker that cannot even start counts as dead
            reason = f"{type(e).__name__}: {e}"
        self._down(worker_id, reason)

    async def _ping_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.ping_interval_s)
            ready = [e for e in self._entries.values() if e.ready.is_set()]
            results = await asyncio.gather(*map(self._ping, ready), return_exceptions=True)
            for entry, result in zip(ready, results, strict=True):
                if not isinstance(result, BaseException):
                    entry.missed_pings = 0
                    continue
                entry.missed_pings += 1
                if entry.missed_pings >= self._config.ping_misses_to_down:
                    reason = f"{entry.missed_pings} pings failed, last: {type(result).__name__}"
                    self._down(entry.spec.worker_id, reason)

    async def _ping(self, entry: _Entry) -> None:
        # The ping is made only once this runs: a round cancelled before it starts (the
        # controller stopping) leaves no coroutine behind that was never awaited.
        await asyncio.wait_for(entry.client.ping(), self._config.ping_timeout_s)

    def _down(self, worker_id: str, reason: str) -> None:
        entry = self._entries.pop(worker_id, None)
        if entry is None or self._stopping:
            return
        # First the router stops seeing it, then what is left of it is killed (ray.kill
        # can take a while): no request is placed on a worker already out of the registry.
        self._on_worker_down(worker_id, entry.spec.role)
        slot = _slot(worker_id)
        self._down_slots[slot] = WorkerReadiness(
            worker_id, entry.spec.role, "down", reason, time.time()
        )
        log.warning("worker %s is down (%s)", worker_id, reason)
        if entry.watch is not None and entry.watch is not asyncio.current_task():
            entry.watch.cancel()
        entry.client.kill()
        if not self._config.replace_dead:
            return
        successor = self._successor(entry.spec)
        delay_s = self._restart_delay_s(slot)
        if delay_s <= 0:
            self._start_worker(successor)
            return
        log.warning("slot %s crashed again; restarting it in %.1f s", slot, delay_s)
        loop = asyncio.get_running_loop()
        self._restarts.append(loop.call_later(delay_s, self._restart, successor))

    def _restart(self, spec: WorkerSpec) -> None:
        if not self._stopping:
            self._start_worker(spec)

    def _restart_delay_s(self, slot: str) -> float:
        """0 for a slot's first crash (in the window); then the doubling backoff."""
        c = self._config
        crashes = self._crashes.setdefault(slot, _Crashes())
        now_s = time.monotonic()
        crashes.count = crashes.count + 1 if now_s - crashes.last_s < c.crash_window_s else 1
        crashes.last_s = now_s
        if crashes.count == 1:
            return 0.0
        return min(c.max_restart_backoff_s, c.restart_backoff_s * 2 ** (crashes.count - 2))

    def _successor(self, spec: WorkerSpec) -> WorkerSpec:
        base = _slot(spec.worker_id)
        generation = self._generation.get(base, 0) + 1
        self._generation[base] = generation
        return replace(spec, worker_id=f"{base}.r{generation}")


def _slot(worker_id: str) -> str:
    """The slot a worker fills: its id without the replacement generation."""
    return worker_id.split(".r")[0]
