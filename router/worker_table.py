"""Per-worker numbers the SLO-goodput policy prices every request against, as arrays.

Everything that does not depend on the request is computed once per worker
snapshot: the fitted prefill coefficients (with their error margin), the queue
wait of each length class, the decode step time with one more request, the
past-future peak of the running set (a ``PeakTable``), the memory limits. A new
``ClusterView`` usually shares most ``WorkerView`` objects with the previous one
(telemetry arrives one worker at a time, reservations touch one worker), so
``sync`` compares snapshots by identity and recomputes only the rows that
changed. A request then costs a few vectorised numpy operations over the rows.
``SloGoodput.refresh(view)`` runs the sync when telemetry arrives, off the
request path.

The output-length history H a request's draws are made against is the one current
when it was drawn: a running set's table is kept while the set is (a new H redraws
nothing), and a set derived from it by a reservation keeps the shared requests'
draws and draws the new one against today's H. A report's new set is drawn afresh,
and every worker reports at least every 100 ms, so the rows follow H.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.cost_model import CostModel
from router.estimator import remaining_tokens
from router.length import LongPool, SplitMode, prefill_curve, queue_waits_s, queued_work_s
from router.peak_table import PeakTable
from router.prefix_index import PrefixIndex
from router.profile import Profile, QuadCoeffs
from router.running_sets import RunningEntry, RunningSets
from router.types import ClusterView, Role, StepSample, WorkerView

__all__ = ["ROLE_CODES", "TableSettings", "WorkerTable"]

ROLE_CODES = {Role.PREFILL: 0, Role.DECODE: 1, Role.MIXED: 2, Role.ENCODE: 3}


@dataclass(frozen=True, slots=True)
class TableSettings:
    profile: Profile
    split_mode: SplitMode
    memory_fraction: float
    batch_memory_fraction: float
    colocate_roles: tuple[Role, ...]
    use_error_margin: bool
    num_draws: int
    stall_weight: float


class WorkerTable:
    """Row ``i`` describes ``view.workers[i]``; see the module docstring."""

    def __init__(
        self,
        settings: TableSettings,
        cost_model_for: Callable[[str], CostModel],
        rng: np.random.Generator,
    ) -> None:
        self.settings = settings
        self._cost_model_for = cost_model_for
        self._rng = rng
        self._last_step_end_s: dict[str, float] = {}
        self._last_steps: dict[str, tuple[StepSample, ...]] = {}  # the last tuple read
        self.sorted_history: np.ndarray = np.zeros(0)
        self.running_sets = RunningSets(lambda: self.sorted_history, rng, settings.num_draws)
        self.workers: tuple[WorkerView, ...] | None = None
        self.prefix_index = PrefixIndex()
        self.long_pool = LongPool()  # the spatial split's (``size_long_pool``)
        self._allocate(0)

    def _allocate(self, n: int) -> None:
        zeros = lambda: np.zeros(n)  # noqa: E731
        self.role = np.zeros(n, dtype=np.int8)
        self.usable = np.zeros(n, dtype=bool)
        self.in_long_pool = np.zeros(n, dtype=bool)
        self.short_hosts = np.ones(n, dtype=bool)  # where a SHORT prompt may prefill
        self.pa, self.pb, self.pc = zeros(), zeros(), zeros()
        self.wait_short_s, self.wait_long_s = zeros(), zeros()
        # The prefill of the prompts placed here whose images are still on encode workers
        # (``WorkerView.encoding_tokens``): what a prompt that also lands here later waits
        # for on top of the queue.
        self.encoding_wait_s = zeros()
        self.bandwidth = np.ones(n)
        self.link_latency_s = zeros()
        self.kv_bytes_per_token = zeros()
        self.block_size = np.ones(n)
        self.step_base_s, self.step_per_token_s = zeros(), zeros()
        self.chunk_tokens = zeros()  # a full prefill chunk (0: this worker runs no chunks)
        self.chunk_s_per_token = zeros()  # what each chunk token adds to a step
        self.chunk_fixed_s = zeros()  # what a chunk adds to a step beyond its tokens
        self.num_running, self.max_num_seqs = zeros(), zeros()
        self.held_tokens, self.peak_tokens = zeros(), zeros()
        self.inbound_tokens = zeros()  # KV placed to decode here, not yet running here
        self.limit_tokens, self.batch_limit_tokens = zeros(), zeros()
        self.fullness = zeros()
        self.queued_tokens = zeros()
        self.tables: list[PeakTable | None] = [None] * n
        # The sample count of its worker's cost model each row was filled at: a refill
        # that reuses the row's other values holds only while the model is the same.
        self._filled_at: list[int] = [-1] * n
        # Rows without a peak table: what their queue waits were priced with (see
        # ``_refill_queues``), else None.
        self._queue_pricing: list[_QueuePricing | None] = [None] * n
        # Request-independent parts of the checks, so a request costs few array operations.
        self.prefill_penalty = np.full(n, np.inf)  # 0 on usable prefill workers
        self.transfer_s_per_token = zeros()  # kv_bytes_per_token / bandwidth
        self.stall_per_prefill_s = zeros()  # stall_weight × running requests
        self.room_tokens, self.batch_room_tokens = zeros(), zeros()  # limit − held
        self.slack_tokens, self.batch_slack_tokens = zeros(), zeros()  # limit − peak
        self.decode_ok = np.zeros(n, dtype=bool)  # usable decode worker with a free seat
        self.coloc_ok = np.zeros(n, dtype=bool)  # same, for colocated hosts
        self.batch_decode_ok = np.zeros(n, dtype=bool)
        self.batch_coloc_ok = np.zeros(n, dtype=bool)

    # -- keeping up with the view ----------------------------------------------------

    def sync(self, view: ClusterView) -> None:
        new = view.workers
        old = self.workers
        if new is old:
            return
        if old is None or len(new) != len(old):
            self._rebuild(new)
            return
        # Identity, not equality: a snapshot is a new object whenever anything in it moved.
        moved = np.fromiter(map(operator.is_not, new, old), dtype=bool, count=len(new))
        changed = moved.nonzero()[0].tolist()
        for i in changed:
            if new[i].worker_id != old[i].worker_id or new[i].role != old[i].role:
                self._rebuild(new)
                return
        self.workers = new
        self._draw_tables([new[i] for i in changed])
        for i in changed:
            if not self._refill_queues(i, old[i], new[i]) and not self._refill_inbound(
                i, old[i], new[i]
            ):
                self._fill_row(i, new[i])

    def _rebuild(self, workers: Sequence[WorkerView]) -> None:
        self._allocate(len(workers))
        self.workers = tuple(workers)
        self.prefix_index.reset([frozenset()] * len(workers))
        self._draw_tables(workers)
        for i, w in enumerate(workers):
            self._fill_row(i, w)
        self.long_pool.order(workers)
        self._split_hosts()

    def size_long_pool(self, long_share: float, request_shares: tuple[float, float]) -> None:
        """Spatial split: the LONG pool sized to the LONG class's share of the work."""
        if self.long_pool.resize(long_share, request_shares):
            self._split_hosts()

    def _split_hosts(self) -> None:
        in_pool, everyone = self.long_pool.members()
        self.in_long_pool[:] = in_pool
        # With every prefilling worker in the LONG pool, a SHORT prompt goes anywhere.
        self.short_hosts[:] = True if everyone else ~self.in_long_pool

    def _fill_row(self, i: int, w: WorkerView) -> None:
        # Each value is computed once as a Python float and stored; nothing is read back
        # from the arrays (a numpy scalar read costs more than the arithmetic on it).
        s = self.settings
        transfer = s.profile.transfer
        role = w.role
        model = self._cost_model_for(w.worker_id)
        self._ingest_steps(w, model)
        usable = w.alive and not w.draining
        self.role[i] = ROLE_CODES[role]
        self.usable[i] = usable
        self.prefix_index.update(i, w.prefix_digest)
        bandwidth = w.link_bandwidth_bytes_per_s or transfer.bandwidth_bytes_per_s
        self.bandwidth[i] = bandwidth
        latency_s = w.link_latency_s
        self.link_latency_s[i] = transfer.latency_s if latency_s is None else latency_s
        kv_bytes_per_token = w.kv_bytes_per_token or s.profile.kv_bytes_per_token
        self.kv_bytes_per_token[i] = kv_bytes_per_token
        self.block_size[i] = w.block_size

        entry = self._running_entry(w)
        held_total = entry.held_total
        q, queue_coeffs, budget = prefill_curve(w, model, held_total)
        p_margin = 1.0 + (model.prefill_error if s.use_error_margin else 0.0)
        self.pa[i], self.pb[i], self.pc[i] = q.a * p_margin, q.b * p_margin, q.c * p_margin
        self._price_queues(i, w, queue_coeffs, budget, p_margin)

        num_running = len(w.running)
        dec = model.decode_coeffs
        d_margin = 1.0 + (model.decode_error if s.use_error_margin else 0.0)
        step_base_s = (dec.a + dec.b * (num_running + 1) + dec.c * held_total) * d_margin
        self.step_base_s[i] = step_base_s
        self.step_per_token_s[i] = dec.c * d_margin
        # Prefilling here (colocated) puts a chunk of up to budget − B tokens into
        # every step the running sequences wait on; 0 where the budget is unknown.
        chunk = max(0, w.prefill_budget_tokens - num_running - 1)
        prefill = model.prefill_coeffs
        # A fit from few mixed steps can make the slope negative: a chunk never makes a
        # step shorter.
        per_token_s = max(0.0, prefill.b) * p_margin
        if chunk and role is not Role.PREFILL:
            self.chunk_tokens[i] = chunk
            self.chunk_s_per_token[i] = per_token_s
            self.chunk_fixed_s[i] = max(0.0, prefill.a - dec.a) * p_margin
        else:
            self.chunk_tokens[i] = self.chunk_s_per_token[i] = self.chunk_fixed_s[i] = 0.0
        self.num_running[i] = num_running
        self.max_num_seqs[i] = w.max_num_seqs
        self.held_tokens[i] = held_total
        self.inbound_tokens[i] = w.inbound_tokens

        total_blocks = w.num_total_blocks or s.profile.num_kv_blocks
        free_blocks = w.num_free_blocks if w.num_total_blocks else total_blocks
        capacity = total_blocks * w.block_size
        other = max(0.0, (total_blocks - free_blocks) * w.block_size - held_total)
        limit = s.memory_fraction * capacity - other
        batch_limit = s.batch_memory_fraction * capacity - other
        self.limit_tokens[i] = limit
        self.batch_limit_tokens[i] = batch_limit

        decode, coloc = role is Role.DECODE, role in s.colocate_roles
        if decode or coloc:
            table = self._peak_table(entry)
            self.tables[i] = table
            peak = table.peak_tokens
            self._queue_pricing[i] = None
        else:
            self.tables[i] = None
            peak = 0.0
            self._queue_pricing[i] = _QueuePricing(queue_coeffs, budget, p_margin)
        self._filled_at[i] = model.num_samples
        self.peak_tokens[i] = peak

        # What every request's checks share.
        self.fullness[i] = peak / limit if limit > 0 else np.inf
        self.prefill_penalty[i] = 0.0 if usable and role is Role.PREFILL else np.inf
        self.transfer_s_per_token[i] = kv_bytes_per_token / bandwidth
        self.stall_per_prefill_s[i] = s.stall_weight * num_running
        self.room_tokens[i], self.batch_room_tokens[i] = (
            limit - held_total,
            batch_limit - held_total,
        )
        self.slack_tokens[i], self.batch_slack_tokens[i] = limit - peak, batch_limit - peak
        seat = usable and num_running < w.max_num_seqs
        self.decode_ok[i] = seat and decode and peak < limit
        self.coloc_ok[i] = seat and coloc and peak < limit
        self.batch_decode_ok[i] = seat and decode and peak < batch_limit
        self.batch_coloc_ok[i] = seat and coloc and peak < batch_limit

    def _refill_queues(self, i: int, old: WorkerView, new: WorkerView) -> bool:
        """Row ``i`` anew where ``new`` differs from ``old`` only in its queues (a
        reservation placed or released on a prefill worker: the commonest change at a
        decision) and the row has no peak table: only the queue waits are priced again,
        exactly as ``_fill_row`` would (its other values depend on nothing that moved,
        and it would draw nothing). False: the row needs ``_fill_row``."""
        pricing = self._queue_pricing[i]
        if (
            pricing is None
            or self._model_moved(i, new)
            or old.inbound_tokens != new.inbound_tokens
            or not _same_but_queues_and_inbound(old, new)
        ):
            return False
        self._price_queues(i, new, pricing.queue_coeffs, pricing.budget, pricing.margin)
        return True

    def _refill_inbound(self, i: int, old: WorkerView, new: WorkerView) -> bool:
        """Row ``i`` anew where ``new`` differs from ``old`` only in the KV placed to
        decode there (a reservation that started on its decode worker: its running row
        stays until the next report) and the row has a peak table: only that column
        moves, exactly as ``_fill_row`` would set it. False: the row needs more."""
        if (
            self.tables[i] is None
            or self._model_moved(i, new)
            or old.queued_tokens != new.queued_tokens
            or old.queued_requests != new.queued_requests
            or old.queued_encode_tokens != new.queued_encode_tokens
            or old.queued_encodes != new.queued_encodes
            or old.encoding_tokens != new.encoding_tokens
            or not _same_but_queues_and_inbound(old, new)
        ):
            return False
        self.inbound_tokens[i] = new.inbound_tokens
        return True

    def _model_moved(self, i: int, w: WorkerView) -> bool:
        """The worker's cost model has learnt since row ``i`` was filled."""
        return self._cost_model_for(w.worker_id).num_samples != self._filled_at[i]

    def _price_queues(
        self, i: int, w: WorkerView, coeffs: QuadCoeffs, budget: int, margin: float
    ) -> None:
        """Row ``i``'s queued tokens and each length class's queue wait (with ``margin``):
        the queued prompts' prefill and the encodes of those the worker encodes itself,
        which run in the steps every queued prompt waits on."""
        queued, counts = w.queued_tokens, w.queued_requests
        self.queued_tokens[i] = sum(queued.values())
        short_s, long_s = queue_waits_s(coeffs, queued, counts, budget, w.long_prefill_tokens)
        if w.queued_encode_tokens:
            model = self._cost_model_for(w.worker_id)
            encodes_s = model.encode_work_s(w.queued_encodes, w.queued_encode_tokens)
            short_s += encodes_s
            long_s += encodes_s
        self.wait_short_s[i] = short_s * margin
        self.wait_long_s[i] = long_s * margin
        encoding_s = queued_work_s(coeffs, budget, w.encoding_tokens, w.encoding_requests)
        self.encoding_wait_s[i] = encoding_s * margin

    def _running_entry(self, w: WorkerView) -> RunningEntry:
        return self.running_sets.entry(w.worker_id, w.running)

    def _draw_tables(self, workers: Sequence[WorkerView]) -> None:
        """Draw at once the peak tables that filling these rows, in this order, would
        draw one by one. The generator fills row-major, in sequence, so one call for all
        gives each table the numbers its own call would, and a draw is elementwise: the
        same tables and generator state, for one call of each kind instead of one per
        table (a decision's sync usually draws two or three)."""
        colocate = self.settings.colocate_roles
        history = self.sorted_history
        due = []
        for w in workers:
            if w.role is Role.DECODE or w.role in colocate:
                entry = self._running_entry(w)
                if entry.table is None:
                    due.append(entry)
        if len(due) < 2:
            return  # ``_peak_table`` draws it, if any
        num_draws = self.settings.num_draws
        sizes = [len(e.rows) for e in due]
        flat = self._rng.random(num_draws * sum(sizes))
        blocks, start = [], 0
        for n in sizes:
            blocks.append(flat[start : start + num_draws * n].reshape(num_draws, n))
            start += num_draws * n
        rows = np.concatenate([e.rows for e in due])
        u = np.concatenate(blocks, axis=1)
        r = remaining_tokens(history, rows[:, 1], rows[:, 2], u)
        column = 0
        for entry, n in zip(due, sizes, strict=True):
            remaining = r[:, column : column + n]
            entry.table = PeakTable(remaining, entry.rows[:, 0])
            entry.remaining = remaining
            column += n

    def _peak_table(self, entry: RunningEntry) -> PeakTable:
        """Drawn once per running set, against H as it is then (see the module)."""
        if entry.table is not None:
            return entry.table
        rows = entry.rows
        u = self._rng.random((self.settings.num_draws, len(rows)))
        r = remaining_tokens(self.sorted_history, rows[:, 1], rows[:, 2], u)
        entry.table = PeakTable(r, rows[:, 0])
        entry.remaining = r
        return entry.table

    def _ingest_steps(self, w: WorkerView, model: CostModel) -> None:
        steps = w.recent_steps
        if self._last_steps.get(w.worker_id) is steps:
            return  # the same tuple: every sample in it was seen
        self._last_steps[w.worker_id] = steps
        last = self._last_step_end_s.get(w.worker_id, -np.inf)
        newest = last
        for sample in steps:
            if sample.end_s > last:
                model.observe(sample)
                newest = max(newest, sample.end_s)
        self._last_step_end_s[w.worker_id] = newest

    def is_role(self, role: Role) -> np.ndarray:
        mask: np.ndarray = (self.role == ROLE_CODES[role]) & self.usable
        return mask

    def in_roles(self, roles: Sequence[Role]) -> np.ndarray:
        mask = np.zeros(len(self.role), dtype=bool)
        for role in roles:
            mask |= self.role == ROLE_CODES[role]
        result: np.ndarray = mask & self.usable
        return result


@dataclass(frozen=True, slots=True)
class _QueuePricing:
    """What a row's queue waits were priced with: the queue's per-step curve, the step
    budget and the error margin."""

    queue_coeffs: QuadCoeffs
    budget: int
    margin: float


def _same_but_queues_and_inbound(old: WorkerView, new: WorkerView) -> bool:
    """Every field but the queues and the inbound KV the same (tuples and sets by
    identity)."""
    return (
        old.running is new.running
        and old.recent_steps is new.recent_steps
        and old.prefix_digest is new.prefix_digest
        and old.alive == new.alive
        and old.draining == new.draining
        and old.num_total_blocks == new.num_total_blocks
        and old.num_free_blocks == new.num_free_blocks
        and old.block_size == new.block_size
        and old.link_bandwidth_bytes_per_s == new.link_bandwidth_bytes_per_s
        and old.link_latency_s == new.link_latency_s
        and old.kv_bytes_per_token == new.kv_bytes_per_token
        and old.max_num_seqs == new.max_num_seqs
        and old.prefill_budget_tokens == new.prefill_budget_tokens
        and old.long_prefill_tokens == new.long_prefill_tokens
    )
