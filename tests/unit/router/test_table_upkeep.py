"""The cheaper table upkeep fills each worker's row exactly as the code it replaced
(issue #13's speed), in the pattern of ``test_view_upkeep.py``.

The replaced ``WorkerTable`` methods are kept here as the reference. Two tables start
from the same seed; one runs today's code, the other the reference, over the views a
``Router`` produces on randomized traffic (reports, placements, releases, transfers,
step samples), and after every sync every column, every peak table and the state of
the random generator must be bit for bit the same: the policy reads only these, so it
decides the same.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from itertools import chain

import numpy as np
import pytest

from router.cost_model import CostModel
from router.estimator import remaining_tokens
from router.front_door import Router, RouterSettings
from router.length import SplitMode, prefill_curve, queue_wait_s
from router.peak_table import PeakTable
from router.profile import DEFAULT_PROFILE
from router.running_sets import ROW_FIELDS, RunningEntry, RunningSets, extended_entry, new_entry
from router.types import (
    LengthClass,
    Plan,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
    WorkerView,
)
from router.worker_table import ROLE_CODES, TableSettings, WorkerTable
from services.workers.messages import WorkerSnapshot


# -- the replaced code -------------------------------------------------------------------
def _reference_rows(running: tuple[RunningRequest, ...]) -> np.ndarray:
    n = len(running)
    flat = np.fromiter(chain.from_iterable(map(ROW_FIELDS, running)), np.float64, 3 * n)
    return flat.reshape(n, 3)


def _reference_running_entry(t: WorkerTable, w: WorkerView) -> RunningEntry:
    # The cache, and which draws it keeps (``_derived``, test_derived_tables.py), is
    # today's; its rows must be the set's, and a kept table the one of its draws.
    entry = t._running_entry(w)
    rows = _reference_rows(w.running)
    assert np.array_equal(entry.rows, rows)
    assert entry.held_total == float(rows[:, 0].sum())
    if entry.table is not None:
        assert entry.remaining is not None
        assert np.array_equal(entry.table._terms, PeakTable(entry.remaining, rows[:, 0])._terms)
    return entry


def _reference_ingest(t: WorkerTable, w: WorkerView, model: CostModel) -> None:
    last = t._last_step_end_s.get(w.worker_id, -np.inf)
    newest = last
    for sample in w.recent_steps:
        if sample.end_s > last:
            model.observe(sample)
            newest = max(newest, sample.end_s)
    t._last_step_end_s[w.worker_id] = newest


def _reference_fill_row(t: WorkerTable, i: int, w: WorkerView) -> None:
    s = t.settings
    model = t._cost_model_for(w.worker_id)
    _reference_ingest(t, w, model)
    t.role[i] = ROLE_CODES[w.role]
    t.usable[i] = w.alive and not w.draining
    t.prefix_index.update(i, w.prefix_digest)
    t.bandwidth[i] = w.link_bandwidth_bytes_per_s or s.profile.transfer.bandwidth_bytes_per_s
    latency_s = w.link_latency_s
    t.link_latency_s[i] = s.profile.transfer.latency_s if latency_s is None else latency_s
    t.kv_bytes_per_token[i] = w.kv_bytes_per_token or s.profile.kv_bytes_per_token
    t.block_size[i] = w.block_size
    t.queued_tokens[i] = sum(w.queued_tokens.values())
    entry = _reference_running_entry(t, w)
    held_total = entry.held_total
    coeffs, queue_coeffs, budget = prefill_curve(w, model, held_total)
    p_margin = 1.0 + (model.prefill_error if s.use_error_margin else 0.0)
    t.pa[i], t.pb[i], t.pc[i] = coeffs.a * p_margin, coeffs.b * p_margin, coeffs.c * p_margin
    queued, counts, q = w.queued_tokens, w.queued_requests, queue_coeffs
    cap = w.long_prefill_tokens
    t.wait_short_s[i] = queue_wait_s(q, queued, counts, LengthClass.SHORT, budget, cap) * p_margin
    t.wait_long_s[i] = queue_wait_s(q, queued, counts, LengthClass.LONG, budget, cap) * p_margin
    num_running = len(w.running)
    dec = model.decode_coeffs
    d_margin = 1.0 + (model.decode_error if s.use_error_margin else 0.0)
    t.step_base_s[i] = (dec.a + dec.b * (num_running + 1) + dec.c * held_total) * d_margin
    t.step_per_token_s[i] = dec.c * d_margin
    chunk = max(0, w.prefill_budget_tokens - num_running - 1)
    prefill = model.prefill_coeffs
    per_token_s = max(0.0, prefill.b) * p_margin
    chunks = bool(chunk) and w.role is not Role.PREFILL
    t.chunk_tokens[i] = chunk if chunks else 0
    t.chunk_s_per_token[i] = per_token_s if chunks else 0.0
    t.chunk_fixed_s[i] = max(0.0, prefill.a - dec.a) * p_margin if chunks else 0.0
    t.num_running[i] = num_running
    t.max_num_seqs[i] = w.max_num_seqs
    t.held_tokens[i] = held_total
    t.inbound_tokens[i] = w.inbound_tokens
    total_blocks = w.num_total_blocks or s.profile.num_kv_blocks
    free_blocks = w.num_free_blocks if w.num_total_blocks else total_blocks
    capacity = total_blocks * w.block_size
    other = max(0.0, (total_blocks - free_blocks) * w.block_size - held_total)
    t.limit_tokens[i] = s.memory_fraction * capacity - other
    t.batch_limit_tokens[i] = s.batch_memory_fraction * capacity - other
    if w.role is Role.DECODE or w.role in s.colocate_roles:
        table = t._peak_table(entry)
        t.tables[i] = table
        t.peak_tokens[i] = table.peak_tokens
    else:
        t.tables[i] = None
        t.peak_tokens[i] = 0.0
    # ``_derive_row``
    usable = bool(t.usable[i])
    peak, held = t.peak_tokens[i], t.held_tokens[i]
    limit, batch_limit = t.limit_tokens[i], t.batch_limit_tokens[i]
    t.fullness[i] = peak / limit if limit > 0 else np.inf
    t.prefill_penalty[i] = 0.0 if usable and w.role is Role.PREFILL else np.inf
    t.transfer_s_per_token[i] = t.kv_bytes_per_token[i] / t.bandwidth[i]
    t.stall_per_prefill_s[i] = s.stall_weight * t.num_running[i]
    t.room_tokens[i], t.batch_room_tokens[i] = limit - held, batch_limit - held
    t.slack_tokens[i], t.batch_slack_tokens[i] = limit - peak, batch_limit - peak
    seat = usable and t.num_running[i] < t.max_num_seqs[i]
    decode, coloc = w.role is Role.DECODE, w.role in s.colocate_roles
    t.decode_ok[i] = seat and decode and peak < limit
    t.coloc_ok[i] = seat and coloc and peak < limit
    t.batch_decode_ok[i] = seat and decode and peak < batch_limit
    t.batch_coloc_ok[i] = seat and coloc and peak < batch_limit


class _ReferenceTable(WorkerTable):
    def _draw_tables(self, workers: Sequence[WorkerView]) -> None:
        # The reference draws each new set's table as it fills the row; the sets derived
        # from a cached one (today's ``_running_entry``) are taken first, in row order,
        # as ``_draw_tables`` does before drawing the others at once.
        for w in workers:
            if w.role is Role.DECODE or w.role in self.settings.colocate_roles:
                _reference_running_entry(self, w)

    def _fill_row(self, i: int, w: WorkerView) -> None:
        _reference_fill_row(self, i, w)


# -- the traffic -------------------------------------------------------------------------
_COLUMNS = [
    "role",
    "usable",
    "in_long_pool",
    "pa",
    "pb",
    "pc",
    "wait_short_s",
    "wait_long_s",
    "bandwidth",
    "link_latency_s",
    "kv_bytes_per_token",
    "block_size",
    "step_base_s",
    "step_per_token_s",
    "chunk_tokens",
    "chunk_s_per_token",
    "chunk_fixed_s",
    "num_running",
    "max_num_seqs",
    "held_tokens",
    "peak_tokens",
    "inbound_tokens",
    "limit_tokens",
    "batch_limit_tokens",
    "fullness",
    "queued_tokens",
    "prefill_penalty",
    "transfer_s_per_token",
    "stall_per_prefill_s",
    "room_tokens",
    "batch_room_tokens",
    "slack_tokens",
    "batch_slack_tokens",
    "decode_ok",
    "coloc_ok",
    "batch_decode_ok",
    "batch_coloc_ok",
]


def _running(rng: random.Random, role: Role) -> tuple[RunningRequest, ...]:
    count = rng.randint(0, 12) if role is not Role.PREFILL else 0
    return tuple(
        RunningRequest(rng.randint(10, 3000) + (g := rng.randint(0, 300)), g, 400)
        for _ in range(count)
    )


def _snapshot(
    rng: random.Random,
    wid: str,
    role: Role,
    seq: int,
    last: WorkerSnapshot | None,
) -> WorkerSnapshot:
    # Some reports keep the last one's running set or step samples (the same objects),
    # as the simulator's do when they did not move.
    running = last.running if last is not None and rng.random() < 0.3 else _running(rng, role)
    steps = last.recent_steps if last is not None and rng.random() < 0.4 else ()
    if not steps and rng.random() < 0.7:
        n = rng.choice((0, rng.randint(1, 2048)))
        batch = len(running)
        duration_s = rng.uniform(1e-3, 0.2)
        steps = (StepSample(duration_s, n, batch, batch * 500, end_s=float(seq)),)
    return WorkerSnapshot(
        worker_id=wid,
        role=role,
        draining=rng.random() < 0.05,
        seq=seq,
        time_s=float(seq),
        block_size=16,
        num_total_blocks=4000,
        num_free_blocks=rng.randint(0, 4000),
        num_cached_blocks=0,
        num_held_blocks=0,
        running=running,
        waiting_prompt_lens=tuple(rng.randint(1, 3000) for _ in range(rng.randint(0, 6))),
        recent_steps=steps,
        recent_output_lens=(),
        num_preemptions=0,
        num_pending_pulls=0,
        num_finished_requests=0,
        kv_bytes_per_token=1024,
        max_num_seqs=rng.choice((8, 256)),
        max_model_len=32768,
        prefix_digest=(),
        prefill_budget_tokens=rng.choice((0, 512, 2048)),
        long_prefill_tokens=(0, 256)[seq % 2],  # not from rng: the traffic stays as it was
    )


def random_traffic(
    rng: random.Random,
    router: Router,
    num_steps: int,
    report_share: float,
    new_length: Callable[[], float],
) -> Iterator[float | None]:
    """Nine workers (prefill, decode, mixed in turn) report to ``router``, then for
    ``num_steps`` steps one random action each: a worker reports (``report_share`` of
    them), a placed request is released (on all its workers or one), an output length
    finishes (``new_length()``), or a request is reserved on random workers. Yields after
    each step: the finished length, or None."""
    roles = {f"w{i}": (Role.PREFILL, Role.DECODE, Role.MIXED)[i % 3] for i in range(9)}
    last: dict[str, WorkerSnapshot] = {}

    def report(wid: str) -> None:
        seq = last[wid].seq + 1 if wid in last else 1
        last[wid] = _snapshot(rng, wid, roles[wid], seq, last.get(wid))
        router.update(last[wid])

    for wid in roles:
        report(wid)
    placed: list[str] = []
    for k in range(num_steps):
        action = rng.random()
        finished = None
        if action < report_share:
            report(rng.choice(list(roles)))
        elif action < 0.45 and placed:
            rid = placed.pop(rng.randrange(len(placed)))
            router.release(rid, rng.choice((None, *roles)))
        elif action < 0.5:
            finished = new_length()
        else:
            wids = [w for w, r in roles.items() if r is not Role.PREFILL]
            prompt = rng.randint(1, 6000)
            profile = RequestProfile(f"r{k}", prompt, prompt, rng.randint(1, 400))
            plan = Plan(rng.choice(list(roles)), rng.choice((None, *wids)))
            router.reserve(replace(profile, arrival_s=k * 0.01), plan, k * 0.01)
            placed.append(profile.request_id)
        yield finished


def _assert_same(new: WorkerTable, ref: WorkerTable) -> None:
    for name in _COLUMNS:
        assert np.array_equal(getattr(new, name), getattr(ref, name)), name
    for a, b in zip(new.tables, ref.tables, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert np.array_equal(a.peaks, b.peaks)
            assert np.array_equal(a._terms, b._terms)
    assert new._rng.bit_generator.state == ref._rng.bit_generator.state


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_the_replaced_fill_on_random_traffic(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    router = Router(RouterSettings(policy="round_robin"))
    settings = TableSettings(
        profile=DEFAULT_PROFILE,
        split_mode=(SplitMode.TEMPORAL, SplitMode.SPATIAL)[seed % 2],
        memory_fraction=0.95,
        batch_memory_fraction=0.8,
        colocate_roles=(Role.MIXED, Role.DECODE),
        use_error_margin=True,
        num_draws=5,
        stall_weight=1.0,
    )
    models: tuple[dict[str, CostModel], dict[str, CostModel]] = ({}, {})
    new = WorkerTable(
        settings,
        lambda wid: models[0].setdefault(wid, CostModel(DEFAULT_PROFILE)),
        np.random.default_rng(seed),
    )
    ref = _ReferenceTable(
        settings,
        lambda wid: models[1].setdefault(wid, CostModel(DEFAULT_PROFILE)),
        np.random.default_rng(seed),
    )
    history = np.sort(np.array([rng.randint(1, 600) for _ in range(50)], dtype=np.float64))
    new.sorted_history = ref.sorted_history = history
    extended: list[RunningEntry] = []

    def counted(entries: list[RunningEntry], running: tuple[RunningRequest, ...]) -> object:
        entry = extended_entry(entries, running)
        if entry is not None:
            extended.append(entry)
        return entry

    monkeypatch.setattr("router.running_sets.extended_entry", counted)
    derive = RunningSets._derived
    derived: list[RunningEntry | None] = []

    def counted_derived(
        t: RunningSets, entries: Sequence[RunningEntry], running: tuple[RunningRequest, ...]
    ) -> RunningEntry | None:
        entry = derive(t, entries, running)
        derived.append(entry)
        return entry

    monkeypatch.setattr(RunningSets, "_derived", counted_derived)
    for finished in random_traffic(rng, router, 400, 0.3, lambda: rng.randint(1, 600)):
        if finished is not None:
            history = np.sort(np.append(history[1:], finished).astype(np.float64))
            new.sorted_history = ref.sorted_history = history
        view = router.view()
        new.sync(view)
        ref.sync(view)
        _assert_same(new, ref)
    assert len(extended) > 20  # reservations were added on top of known running sets
    assert sum(e is not None for e in derived) > 20  # and kept their draws


@pytest.mark.parametrize("seed", range(4))
def test_an_extended_running_set_has_the_rows_of_a_new_one(seed: int) -> None:
    rng = random.Random(seed)
    base = _running(rng, Role.DECODE)
    entries = [new_entry(_running(rng, Role.DECODE)), new_entry(base)]
    added = tuple(RunningRequest(rng.randint(1, 5000), 0, 400) for _ in range(rng.randint(1, 3)))
    running = (*base, *added)
    extended = extended_entry(entries, running)
    assert extended is not None
    fresh = new_entry(running)
    assert extended.running is running
    assert np.array_equal(extended.rows, fresh.rows)
    assert extended.held_total == fresh.held_total
    # A set that does not start with a cached one is not an extension.
    assert extended_entry(entries, (*added, *base)) is None or not base


def _reference_remaining(
    h: np.ndarray, g: np.ndarray, cap: np.ndarray, u: np.ndarray
) -> np.ndarray:
    """``remaining_tokens`` as it was (module functions, no cached arrays)."""
    cap = np.maximum(cap, g)
    m = len(h)
    lo = np.searchsorted(h, g, side="right")
    count = m - lo
    tail = g + u * (cap - g) if m == 0 or count.min(initial=1) == 0 else None
    if m == 0:
        assert tail is not None
        drawn = tail
    else:
        pos = lo + u * np.maximum(count - 1, 0)
        if m == 1:
            drawn = np.full(pos.shape, h[0])
        else:
            j = np.minimum(pos.astype(np.intp), m - 2)
            drawn = h[j] + (pos - j) * (h[j + 1] - h[j])
        if tail is not None:
            drawn = np.where(count > 0, drawn, tail)
    return np.maximum(np.minimum(drawn, cap) - g - 1.0, 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_draws_and_peak_tables_equal_the_replaced_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for trial in range(300):
        m = (0, 1, 2, 200)[trial % 4]
        h = np.sort(rng.integers(1, 500, m).astype(np.float64))
        n = int(rng.integers(0, 70))
        g = rng.integers(0, 600, n).astype(np.float64)
        cap = rng.choice([1.0, 100.0, 512.0, 4000.0], n)
        u = rng.random((int(rng.integers(1, 6)), n))
        r = remaining_tokens(h, g, cap, u)
        assert np.array_equal(r, _reference_remaining(h, g, cap, u))
        held = rng.integers(1, 3000, n).astype(np.float64)
        table = PeakTable(r, held)
        order = np.argsort(-r, axis=1, kind="stable")
        r_sorted = r[np.arange(len(r))[:, None], order]
        terms = np.arange(1, n + 1) * r_sorted + np.cumsum(held[order], axis=1)
        peaks = terms.max(axis=1) if n else np.zeros(len(r))
        assert np.array_equal(table._terms, terms) and np.array_equal(table.peaks, peaks)
        assert table.peak_tokens == float(peaks.max())
