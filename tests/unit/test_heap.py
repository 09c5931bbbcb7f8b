"""``services.heap.collector_paused``: no cyclic collection inside, the collector as it
was after, and what the block left collected at its end."""

from __future__ import annotations

import gc
import weakref

import pytest

from services.heap import collector_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector frees it


def test_the_collector_is_off_inside_and_collects_what_the_block_left() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        node = _Node()
        left = weakref.ref(node)
        del node
        for _ in range(50_000):  # far past the young generation's threshold
            _Node()
        assert left() is not None  # nothing collected while paused
    assert gc.isenabled()
    assert left() is None  # collected on the way out


def test_an_exception_still_turns_the_collector_back_on() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
