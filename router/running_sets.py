"""A decode worker's running set as the router prices it: rows (c, g, M) and the
memory-estimate draws behind its ``PeakTable``, kept per set (``WorkerTable`` keeps
each worker's last two).

A set usually differs from one already drawn by a reservation: the router shows a
worker's running requests as its report's tuple with each reservation appended, one
object per reservation while it is placed. So a set one request longer than a cached
one (placed) or one shorter (released) is derived from it: the shared requests keep
their rows and their draws, an appended one is drawn alone, and a release draws
nothing and reads no rows. Only a new report's set is read and drawn in full.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from router.estimator import sample_output_lengths_of_one
from router.peak_table import PeakTable
from router.types import RunningRequest

__all__ = [
    "ROW_FIELDS",
    "RunningEntry",
    "RunningSets",
    "derived_entry",
    "extended_entry",
    "new_entry",
    "remaining_tokens_of_one",
    "running_rows",
]

ROW_FIELDS = operator.attrgetter("num_tokens_held", "num_generated", "max_tokens")


@dataclass(slots=True)
class RunningEntry:
    running: tuple[RunningRequest, ...]
    rows: np.ndarray  # (c, g, M) per running request
    held_total: float
    table: PeakTable | None = None
    remaining: np.ndarray | None = None  # the (S, n) draws behind ``table``, a column each


def new_entry(running: tuple[RunningRequest, ...]) -> RunningEntry:
    rows = running_rows(running)
    return RunningEntry(running, rows, float(rows[:, 0].sum()))


def extended_entry(
    entries: Sequence[RunningEntry], running: tuple[RunningRequest, ...]
) -> RunningEntry | None:
    """A cached set with requests appended (the router adds a reservation at the end of
    the report's tuple): its rows plus the new ones' rows, without re-reading the rest.
    Tokens are integers, so the sums are exact in any order: the same rows and total
    as ``new_entry``. Nothing is drawn."""
    for entry in entries:
        old = entry.running
        n = len(old)
        if n < len(running) and running[:n] == old:
            tail = running_rows(running[n:])
            rows = np.concatenate((entry.rows, tail))
            return RunningEntry(running, rows, entry.held_total + float(tail[:, 0].sum()))
    return None


def derived_entry(
    entries: Sequence[RunningEntry],
    running: tuple[RunningRequest, ...],
    history_floats: Callable[[], list[float]],
    rng: np.random.Generator,
    num_draws: int,
) -> RunningEntry | None:
    """``running`` as a cached set with a table, with one request appended (a
    reservation placed) or one left out (one released), with its table; or None.

    The requests it shares with the cached set keep their rows and their draws; an
    appended one is drawn now (``num_draws`` numbers of ``rng``) against today's H
    (``history_floats``: sorted H as floats). Each column is then an independent draw
    of its own request's remaining length against the H of its time, as in a table
    drawn anew, so the estimate has the distribution it had
    (``tests/unit/router/test_derived_tables.py``); the table is ``PeakTable`` of those
    draws. Tokens are integers: the held total is exact in any order."""
    for base in entries:
        if base.table is None or base.remaining is None:
            continue
        old = base.running
        n = len(old)
        if len(running) == n + 1 and (not n or running[n - 1] is old[n - 1]):
            if running[:n] != old:
                continue
            added = running[n]
            u = rng.random(num_draws).tolist()
            drawn = remaining_tokens_of_one(
                history_floats(), added.num_generated, added.max_tokens, u
            )
            remaining = np.empty((num_draws, n + 1))
            remaining[:, :n] = base.remaining
            remaining[:, n] = drawn
            row = (added.num_tokens_held, added.num_generated, added.max_tokens)
            rows = np.concatenate((base.rows, np.array((row,), dtype=np.float64)))
            held_total = base.held_total + added.num_tokens_held
        elif len(running) == n - 1 and n > 1:
            j = n - 1  # the one left out: reservations follow the report, so look back
            while j > 0 and running[j - 1] is old[j]:
                j -= 1
            if running[:j] != old[:j]:
                continue
            remaining = np.concatenate((base.remaining[:, :j], base.remaining[:, j + 1 :]), 1)
            rows = np.concatenate((base.rows[:j], base.rows[j + 1 :]))
            held_total = base.held_total - old[j].num_tokens_held
        else:
            continue
        entry = RunningEntry(running, rows, held_total, remaining=remaining)
        entry.table = PeakTable(remaining, rows[:, 0])
        return entry
    return None


def remaining_tokens_of_one(
    sorted_lengths: list[float], num_generated: float, max_tokens: float, u: list[float]
) -> list[float]:
    """``router.estimator.remaining_tokens`` for one request, a draw per ``u``, in
    Python floats (``sample_output_lengths_of_one``: the same values)."""
    g = num_generated
    drawn = sample_output_lengths_of_one(sorted_lengths, g, max_tokens, u)
    return [max(x - g - 1.0, 0.0) for x in drawn]


def running_rows(running: Sequence[RunningRequest]) -> np.ndarray:
    """(c, g, M) of each running request as an (n, 3) array."""
    n = len(running)
    flat = np.fromiter(chain.from_iterable(map(ROW_FIELDS, running)), np.float64, 3 * n)
    return flat.reshape(n, 3)


class RunningSets:
    """Per worker, its two most recent running sets (newest first), as entries: a
    reservation's and, once released, the report's own again. ``history()`` is sorted H,
    which a derived set's appended request is drawn against."""

    def __init__(
        self, history: Callable[[], np.ndarray], rng: np.random.Generator, num_draws: int
    ) -> None:
        self._history = history
        self._rng = rng
        self._num_draws = num_draws
        self._cache: dict[str, list[RunningEntry]] = {}
        self._history_list: tuple[np.ndarray, list[float]] | None = None  # H as floats

    def entry(self, worker_id: str, running: tuple[RunningRequest, ...]) -> RunningEntry:
        """The worker's running set as rows, with its peak table, kept while the set is
        the same object: a snapshot that moved only queues or free blocks, or a
        reservation released (the router then shows the report's own tuple again), finds
        the rows and draws it had. A set one request longer or shorter than a cached one
        with a table (a reservation added or released) keeps the others' draws
        (``derived_entry``); only a new running set is drawn afresh."""
        entries = self._cache.setdefault(worker_id, [])
        for k, entry in enumerate(entries):
            if entry.running is running:
                if k:
                    entries.insert(0, entries.pop(k))
                return entry
        entry = (
            self._derived(entries, running)
            or extended_entry(entries, running)
            or new_entry(running)
        )
        entries.insert(0, entry)
        del entries[2:]
        return entry

    def cached(self, worker_id: str) -> list[RunningEntry]:
        return self._cache.get(worker_id, [])

    def _derived(
        self, entries: Sequence[RunningEntry], running: tuple[RunningRequest, ...]
    ) -> RunningEntry | None:
        """``running`` derived from a cached set, its draws kept (``derived_entry``)."""
        return derived_entry(entries, running, self.history_floats, self._rng, self._num_draws)

    def history_floats(self) -> list[float]:
        """Sorted H as Python floats, converted once per H (the policy's candidates are
        drawn against it too)."""
        history = self._history()
        cached = self._history_list
        if cached is None or cached[0] is not history:
            cached = self._history_list = (history, history.tolist())
        return cached[1]
