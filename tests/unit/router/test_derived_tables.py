"""A running set one reservation longer or shorter than a cached one keeps the other
requests' memory-estimate draws (``RunningSets._derived``, issue #13's speed).

What is drawn changes, so plans may differ from drawing every set anew; what must
hold is that each table is distributed as one drawn anew: every column is an
independent draw of its own request's remaining length (a fresh one against today's
history, or the same request's earlier one against the history of its time), no
column twice, and the table is exactly ``PeakTable`` of those draws. The traffic test checks that invariant on the
views a ``Router`` produces; the last test compares the estimate's distribution.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.cost_model import CostModel
from router.estimator import remaining_tokens
from router.front_door import Router, RouterSettings
from router.length import SplitMode
from router.peak_table import PeakTable
from router.profile import DEFAULT_PROFILE
from router.running_sets import RunningEntry, new_entry, remaining_tokens_of_one
from router.types import Plan, RequestProfile, Role, RunningRequest, WorkerView
from router.worker_table import TableSettings, WorkerTable
from tests.unit.router.test_table_upkeep import _snapshot, random_traffic


def _settings(num_draws: int = 5) -> TableSettings:
    return TableSettings(
        profile=DEFAULT_PROFILE,
        split_mode=SplitMode.TEMPORAL,
        memory_fraction=0.95,
        batch_memory_fraction=0.8,
        colocate_roles=(Role.MIXED, Role.DECODE),
        use_error_margin=True,
        num_draws=num_draws,
        stall_weight=1.0,
    )


def _decode_table(seed: int, num_draws: int = 5) -> WorkerTable:
    t = WorkerTable(
        _settings(num_draws), lambda wid: CostModel(DEFAULT_PROFILE), np.random.default_rng(seed)
    )
    t.sorted_history = np.sort(np.random.default_rng(seed + 1).uniform(1, 600, 80))
    return t


def _entry_of(t: WorkerTable, running: tuple[RunningRequest, ...]) -> RunningEntry:
    entry = t._running_entry(WorkerView(worker_id="d0", role=Role.DECODE, running=running))
    t._peak_table(entry)
    return entry


@pytest.mark.parametrize("seed", range(4))
def test_one_request_is_drawn_as_remaining_tokens_draws_it(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(500):
        m = (0, 1, 2, 200)[trial % 4]
        h = np.sort(np.concatenate((rng.integers(0, 500, m // 2), rng.uniform(0, 500, m - m // 2))))
        g = float(rng.integers(0, 600))
        cap = float(rng.choice([0.0, 1.0, 100.0, 512.0, 4000.0]))
        u = rng.random((5, 1))
        expected = remaining_tokens(h, np.array([g]), np.array([cap]), u)[:, 0]
        assert remaining_tokens_of_one(h.tolist(), g, cap, u[:, 0].tolist()) == expected.tolist()


@pytest.mark.parametrize("seed", range(8))
def test_a_reservation_keeps_the_base_draws_and_its_release_draws_nothing(seed: int) -> None:
    rng = random.Random(seed)
    t = _decode_table(seed)
    history = t.sorted_history
    base = tuple(
        RunningRequest(rng.randint(10, 3000) + (g := rng.randint(0, 300)), g, 600)
        for _ in range(rng.randint(1, 40))
    )
    a = RunningRequest(rng.randint(10, 3000), 0, 500)
    b = RunningRequest(rng.randint(10, 3000), 0, 450)
    e_base = _entry_of(t, base)
    assert e_base.remaining is not None
    base_remaining = e_base.remaining.copy()
    n = len(base)

    # Appended: the base requests keep their draws; the reservation gets S fresh numbers.
    state = t._rng.bit_generator.state
    e_a = _entry_of(t, (*base, a))
    assert e_a.remaining is not None and e_a.table is not None
    assert np.array_equal(e_a.remaining[:, :n], base_remaining)
    replay = np.random.default_rng()
    replay.bit_generator.state = state
    own = remaining_tokens(history, np.zeros(1), np.array([500.0]), replay.random((5, 1)))
    assert np.array_equal(e_a.remaining[:, n:], own)
    assert replay.bit_generator.state == t._rng.bit_generator.state
    assert np.array_equal(e_a.rows, new_entry((*base, a)).rows)
    assert e_a.held_total == new_entry((*base, a)).held_total
    assert np.array_equal(e_a.table._terms, PeakTable(e_a.remaining, e_a.rows[:, 0])._terms)

    e_ab = _entry_of(t, (*base, a, b))
    assert e_ab.remaining is not None
    assert np.array_equal(e_ab.remaining[:, : n + 1], e_a.remaining)
    # ``a`` released from the middle: the others keep their draws, nothing is drawn.
    state = t._rng.bit_generator.state
    e_b = _entry_of(t, (*base, b))
    assert e_b.remaining is not None and e_b.table is not None
    assert t._rng.bit_generator.state == state
    assert np.array_equal(e_b.remaining[:, :n], base_remaining)
    assert np.array_equal(e_b.remaining[:, n], e_ab.remaining[:, n + 1])
    assert np.array_equal(e_b.rows, new_entry((*base, b)).rows)
    assert e_b.held_total == new_entry((*base, b)).held_total
    assert np.array_equal(e_b.table._terms, PeakTable(e_b.remaining, e_b.rows[:, 0])._terms)
    # A request of the report released (the first): same.
    if n > 1:
        e_first = _entry_of(t, (*base[1:], b))
        assert e_first.remaining is not None and t._rng.bit_generator.state == state
        assert np.array_equal(e_first.remaining, e_b.remaining[:, 1:])
    # A new history redraws nothing drawn: the cached set keeps its table, and one
    # derived from it keeps the shared draws and draws the new request against it.
    t.sorted_history = new_history = np.sort(np.append(history[1:], 333.3))
    state = t._rng.bit_generator.state
    assert _entry_of(t, e_b.running) is e_b and t._rng.bit_generator.state == state
    c = RunningRequest(rng.randint(10, 3000), 0, 400)
    e_c = _entry_of(t, (*e_b.running, c))
    assert e_c.remaining is not None
    assert np.array_equal(e_c.remaining[:, : n + 1], e_b.remaining)
    replay.bit_generator.state = state
    own = remaining_tokens(new_history, np.zeros(1), np.array([400.0]), replay.random((5, 1)))
    assert np.array_equal(e_c.remaining[:, n + 1 :], own)


def _check_draws(
    t: WorkerTable,
    known: dict[bytes, tuple[tuple[float, ...], np.ndarray]],
    num_drawn: int,
    checked: dict[int, PeakTable],
) -> int:
    """Every column of every table is a fresh draw or the column of an equal row drawn
    against the same history; no column twice in a table; the generator handed out
    exactly the fresh columns' numbers (a column with one value throughout is exempt: a
    request with one possible length, any draw gives it). Returns the columns kept."""
    assert t.workers is not None
    num_draws = t.settings.num_draws
    fresh = constant = kept = 0
    for w, table in zip(t.workers, t.tables, strict=True):
        if table is None or id(table) in checked:
            continue  # none, or not drawn in this sync
        checked[id(table)] = table
        entry = next(e for e in t.running_sets.cached(w.worker_id) if e.running is w.running)
        assert entry.table is table
        r = entry.remaining
        assert r is not None and r.shape == (num_draws, len(w.running))
        assert np.array_equal(table._terms, PeakTable(r, entry.rows[:, 0])._terms)
        seen: set[bytes] = set()
        for j in range(r.shape[1]):
            column = r[:, j]
            if column.min() == column.max():
                constant += 1
                continue
            key = column.tobytes()
            assert key not in seen  # each request its own draws
            seen.add(key)
            row = tuple(entry.rows[j].tolist())
            if key in known:  # the same request's draw, kept (against the H of its time)
                was_row, _ = known[key]
                assert was_row == row
                kept += 1
            else:
                known[key] = (row, t.sorted_history)
                fresh += 1
    assert fresh * num_draws <= num_drawn <= (fresh + constant) * num_draws
    return kept


class _FakeCountingRng:
    """A generator that counts the numbers it hands out (the draws of one sync)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self.bit_generator = rng.bit_generator
        self.count = 0

    def random(self, size: int | tuple[int, int]) -> np.ndarray:
        out = self._rng.random(size)
        self.count += out.size
        return out


@pytest.mark.parametrize("seed", range(6))
def test_every_column_is_its_own_requests_draw_on_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    router = Router(RouterSettings(policy="round_robin"))
    t = _decode_table(seed)
    counter = _FakeCountingRng(t._rng)
    t._rng = t.running_sets._rng = counter  # type: ignore[assignment]
    # Distinct lengths: a draw that is not capped is then a value no other draw has.
    history = np.sort(np.array([rng.uniform(1, 600) for _ in range(50)]))
    t.sorted_history = history
    known: dict[bytes, tuple[tuple[float, ...], np.ndarray]] = {}
    checked: dict[int, PeakTable] = {}  # the tables seen (kept alive: ids stay unique)
    kept = 0
    for finished in random_traffic(rng, router, 400, 0.2, lambda: rng.uniform(1, 600)):
        if finished is not None:
            history = np.sort(np.append(history[1:], finished))
            t.sorted_history = history
        counter.count = 0
        t.sync(router.view())
        kept += _check_draws(t, known, counter.count, checked)
    assert kept > 200  # requests kept their draws across reservations and releases


def test_kept_draws_give_the_estimate_of_fresh_ones() -> None:
    """Over many seeds, the peak of a set reached by reservations placed on a drawn set
    and one released (base draws kept, each reservation drawn once) is distributed as
    the peak of the same set drawn from scratch: same mean, same spread, within
    sampling error. Reusing a base column for a reservation, or drawing it
    unconditioned, moves the mean."""
    kept, fresh = [], []
    for seed in range(600):
        rng = random.Random(seed)
        t = _decode_table(seed, num_draws=3)
        base = tuple(
            RunningRequest(rng.randint(100, 2000) + (g := rng.randint(0, 300)), g, 600)
            for _ in range(12)
        )
        a, b, c = (
            RunningRequest(1500, 0, 600),
            RunningRequest(900, 0, 300),
            RunningRequest(700, 0, 500),
        )
        for running in (base, (*base, a), (*base, a, b), (*base, b), (*base, b, c)):
            entry = _entry_of(t, running)
        assert entry.table is not None
        kept.append(entry.table.peak_tokens)
        rows = new_entry((*base, b, c)).rows
        u = np.random.default_rng(10_000 + seed).random((3, len(rows)))
        r = remaining_tokens(t.sorted_history, rows[:, 1], rows[:, 2], u)
        fresh.append(PeakTable(r, rows[:, 0]).peak_tokens)
    x, y = np.array(kept), np.array(fresh)
    se = np.sqrt(x.var() / len(x) + y.var() / len(y))
    assert abs(x.mean() - y.mean()) < 4 * se
    assert 0.85 < x.std() / y.std() < 1.15


def test_a_reservation_is_one_running_object_while_it_is_placed() -> None:
    """The router shows a reservation as the same object in every view of its decode
    worker (what lets the table keep its draws), until it is released."""
    router = Router(RouterSettings(policy="round_robin"))
    rng = random.Random(0)
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        router.update(_snapshot(rng, wid, role, 1, None))
    profile = RequestProfile("r0", 100, 100, 50)
    router.reserve(profile, Plan("p0", "d0"), 0.0)
    first = router.view().workers[1].running[-1]
    router.reserve(RequestProfile("r1", 200, 200, 50), Plan("p0", "d0"), 0.0)
    running = router.view().workers[1].running
    assert running[-2] is first and running[-1] is not first
    router.release("r0")
    assert first not in router.view().workers[1].running
