"""The engine thread's CPU priority, by role (``workers.nice``, ``workers.prefill_nice``).

On a CPU host the engines share cores with each other and with the gateway. A
prompt's first token comes when the step that prefills it ends, and admission
prices that step from the prefill worker's recent speed; when decode batches take
the shared cores, prefill steps slow 2-4x from one step to the next and the prompts
admitted into a slow step miss their TTFT together. So prefill (and encode, which a
prefill waits on) engines can run at a lower nice value than decode and mixed ones.

Linux keeps a nice value per thread: the engine loop's thread sets its own (torch
runs a worker's ops on it with ``engine.num_threads: 1``), and the worker's
transport threads, which answer the gateway, keep theirs. A role flip moves the
thread to its new role's value. Raising a nice value is always allowed; lowering it
needs ``CAP_SYS_NICE`` (or a ``RLIMIT_NICE`` that allows it): where that is refused
(or the platform keeps no per-thread value) the thread keeps the value it has, and the
refusal is logged once per worker; the loop goes on.
"""

from __future__ import annotations

import logging
import os
import threading

from router.types import Role

__all__ = ["FIRST_TOKEN_ROLES", "RolePriority"]

log = logging.getLogger(__name__)

# Roles whose steps a prompt's first token waits on, and nothing else's.
FIRST_TOKEN_ROLES = (Role.PREFILL, Role.ENCODE)


class RolePriority:
    """Called from the engine thread only: ``follow(role)`` at start and after every
    role change sets the thread's nice value to its value at start plus ``nice``, or
    plus ``prefill_nice`` for prefill and encode (capped at 19)."""

    def __init__(self, worker_id: str, nice: int, prefill_nice: int) -> None:
        self._worker_id = worker_id
        self._offsets = (nice, prefill_nice)
        self._base: int | None = None  # the thread's nice value before the first change
        self._thread_id = 0
        self._role: Role | None = None
        self._warned = False

    def follow(self, role: Role) -> None:
        if role is self._role:
            return
        self._role = role
        nice, prefill_nice = self._offsets
        if not (nice or prefill_nice):
            return  # nothing to set: the thread keeps what it inherited
        if self._base is None:
            self._thread_id = threading.get_native_id()
            self._base = os.getpriority(os.PRIO_PROCESS, self._thread_id)
        offset = prefill_nice if role in FIRST_TOKEN_ROLES else nice
        target = min(19, self._base + offset)
        try:
            os.setpriority(os.PRIO_PROCESS, self._thread_id, target)
        except OSError as e:  # lowering without CAP_SYS_NICE; a platform without thread ids
            if not self._warned:
                self._warned = True
                log.warning(
                    "worker %s: cannot set its engine thread's nice value to %d for the %s "
                    "role (%s; lowering it needs CAP_SYS_NICE); it keeps the one it has",
                    self._worker_id,
                    target,
                    role.value,
                    e,
                )
