"""``RolePriority``: the engine thread's nice value by role, set once per role change,
and a refused change logged once without stopping the loop."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from router.types import Role
from services.workers import priority
from services.workers.priority import RolePriority


def test_each_role_change_sets_its_value_once_and_a_refusal_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    asked: list[int] = []

    def refuse(which: int, who: int, value: int) -> None:
        assert (which, who) == (os.PRIO_PROCESS, threading.get_native_id())
        asked.append(value)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(priority.os, "setpriority", refuse)
    p = RolePriority("w", nice=6, prefill_nice=2)
    with caplog.at_level(logging.WARNING, logger=priority.__name__):
        for role in (Role.PREFILL, Role.DECODE, Role.DECODE, Role.ENCODE, Role.MIXED):
            p.follow(role)  # never raises
    assert asked == [min(19, base + n) for n in (2, 6, 2, 6)]  # none for a role kept
    warnings = [r for r in caplog.records if "cannot set its engine thread's nice" in r.message]
    assert len(warnings) == 1 and "CAP_SYS_NICE" in warnings[0].message


def test_without_nice_values_the_thread_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def untouchable(which: int, who: int, value: int) -> None:
        raise AssertionError("setpriority called")

    monkeypatch.setattr(priority.os, "setpriority", untouchable)
    p = RolePriority("w", nice=0, prefill_nice=0)
    for role in (Role.PREFILL, Role.DECODE, Role.PREFILL):
        p.follow(role)
