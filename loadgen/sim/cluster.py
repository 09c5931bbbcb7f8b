"""The discrete-event cluster: arrivals, the REAL router, workers, KV transfer links.

Event loop (one heap, ordered by time then sequence number)::

    ARRIVAL   a request reaches the gateway  -> router.plan(profile, view, now)
    RETRY     a held request asks again      -> router.plan(...)
    STEP_END  a worker's step/segment ends   -> tokens advance, finishes recorded
    LANDED    a KV transfer completes        -> decode worker may admit it

The router sees ``ClusterView``s built from the simulated workers' state, the
same shape the gateway builds from telemetry, with the gateway's in-flight
reservations (requests planned to a decode worker but not yet admitted there)
counted on that worker. A worker's view is rebuilt only after its state
changed, so a decision costs O(workers) pointer copies plus the policy itself.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from loadgen.metrics import RequestRecord
from loadgen.sim.profile import Profile
from loadgen.sim.worker import Admission, SimRequest, SimWorker
from loadgen.workload import RequestSpec
from router.policy import Policy
from router.types import (
    SLO,
    ClusterView,
    Plan,
    Reject,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
    WorkerView,
)

__all__ = ["SimCluster"]

_ARRIVAL, _RETRY, _STEP_END, _LANDED = 0, 1, 2, 3
_HISTORY = 200  # finished output lengths kept for the router's estimator

_new_running = RunningRequest.__new__
_set_held = RunningRequest.num_tokens_held.__set__  # type: ignore[attr-defined,misc]
_set_generated = RunningRequest.num_generated.__set__  # type: ignore[attr-defined,misc]
_set_max_tokens = RunningRequest.max_tokens.__set__  # type: ignore[attr-defined,misc]


def _running(held: int, generated: int, max_tokens: int) -> RunningRequest:
    """``RunningRequest(held, generated, max_tokens)`` through its slots: the frozen
    dataclass ``__init__`` costs more than the rest of a view, at 256 per worker."""
    r = _new_running(RunningRequest)
    _set_held(r, held)
    _set_generated(r, generated)
    _set_max_tokens(r, max_tokens)
    return r


class SimCluster:
    def __init__(
        self,
        profile: Profile,
        policy: Policy,
        roles: list[Role],
        slo: SLO,
        prefill_budget_tokens: int = 8192,
        chunk_tokens: int = 512,
        prefix_caching: bool = False,
        max_hold_s: float = 30.0,
        hold_poll_s: float = 0.05,
        max_tokens: int | None = None,
        make_admission: Callable[[], Admission] | None = None,
    ) -> None:
        self.profile = profile
        self.policy = policy
        self.slo = slo
        self.prefix_caching = prefix_caching
        self.max_hold_s = max_hold_s
        self.hold_poll_s = hold_poll_s
        self.max_tokens = max_tokens
        self._dirty: list[SimWorker] = []
        self.workers = [
            SimWorker(
                f"{role.value}-{i}",
                role,
                profile,
                prefill_budget_tokens if role is Role.PREFILL else chunk_tokens,
                self._schedule_step,
                self._on_prefilled,
                self._on_finished,
                self._on_step,
                self._dirty,
                make_admission() if make_admission and role is not Role.PREFILL else None,
            )
            for i, role in enumerate(roles)
        ]
        self._by_id = {w.worker_id: w for w in self.workers}
        self._index = {w.worker_id: i for i, w in enumerate(self.workers)}
        self._views: list[WorkerView | None] = [None] * len(self.workers)
        self._steps: dict[str, deque[StepSample]] = {
            w.worker_id: deque(maxlen=4) for w in self.workers
        }
        self._caches: dict[str, OrderedDict[int, None]] = {
            w.worker_id: OrderedDict() for w in self.workers
        }
        self._link_free_s: dict[str, float] = {w.worker_id: 0.0 for w in self.workers}
        self._history: deque[int] = deque(maxlen=_HISTORY)
        self._history_view: tuple[int, ...] = ()
        self._heap: list[tuple[float, int, int, object, int]] = []
        self._seq = 0
        self.records: list[RequestRecord] = []
        self.itl_values_s: list[float] = []
        self.itl_weights: list[float] = []
        self.num_events = 0
        self.num_decisions = 0
        self.num_rejected = 0
        # (router's predicted TTFT, simulated TTFT) per served request, where the policy predicts.
        self.ttft_predictions: list[tuple[float, float]] = []
        self._pending: Iterator[RequestSpec] | None = None  # closed loop: next to send

    # ---- driving ------------------------------------------------------------
    def run_open_loop(self, specs: list[RequestSpec]) -> None:
        for spec in specs:
            self._push(spec.arrival_s, _ARRIVAL, self._new_request(spec, spec.arrival_s), 0)
        self._loop()

    def run_closed_loop(self, specs: list[RequestSpec], concurrency: int) -> None:
        self._pending = iter(specs)
        for _ in range(concurrency):
            self._send_next(0.0)
        self._loop()

    def _send_next(self, now_s: float) -> None:
        if self._pending is None:
            return
        spec = next(self._pending, None)
        if spec is not None:
            self._push(now_s, _ARRIVAL, self._new_request(spec, now_s), 0)

    def _new_request(self, spec: RequestSpec, arrival_s: float) -> SimRequest:
        max_tokens = self.max_tokens if self.max_tokens is not None else spec.output_len
        req = SimRequest(
            spec.request_id,
            arrival_s,
            spec.input_len,
            spec.output_len,
            max(max_tokens, spec.output_len),
            spec.hash_ids if self.prefix_caching else (),
        )
        return req

    def _loop(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            now_s, _, kind, payload, version = pop(heap)
            self.num_events += 1
            if kind == _STEP_END:
                worker = payload
                assert isinstance(worker, SimWorker)
                if version == worker.version:
                    worker.end_step(now_s)
            elif kind == _LANDED:
                assert isinstance(payload, SimRequest)
                assert payload.decode_worker is not None
                payload.decode_worker.enqueue_decode(payload, now_s)
            else:
                assert isinstance(payload, SimRequest)
                self._route(payload, now_s)

    def _push(self, time_s: float, kind: int, payload: object, version: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, kind, payload, version))

    def _schedule_step(self, time_s: float, worker: SimWorker, version: int) -> None:
        self._push(time_s, _STEP_END, worker, version)

    # ---- routing ----------------------------------------------------------------
    def _route(self, req: SimRequest, now_s: float) -> None:
        profile = RequestProfile(
            request_id=req.request_id,
            num_prompt_tokens=req.input_len,
            num_new_tokens=req.input_len,
            max_tokens=req.max_tokens,
            slo=self.slo,
            prefix_hashes=req.hash_ids,
            arrival_s=req.arrival_s,
        )
        self.num_decisions += 1
        decision = self.policy.plan(profile, self._cluster_view(now_s), now_s)
        match decision:
            case Plan():
                self._place(req, decision, now_s)
            case Reject(hold=True) if now_s - req.arrival_s < self.max_hold_s:
                self._push(now_s + min(decision.retry_after_s, self.hold_poll_s), _RETRY, req, 0)
            case Reject():
                self._fail(req, f"rejected: {decision.reason}", now_s)

    def _place(self, req: SimRequest, plan: Plan, now_s: float) -> None:
        prefill = self._by_id[plan.prefill_worker]
        req.length_class = plan.length_class
        if plan.predicted_ttft_s is not None:
            req.predicted_ttft_s = plan.predicted_ttft_s + (now_s - req.arrival_s)
        if plan.colocated:
            req.decode_worker = None
            prefill.reserved[req.request_id] = req
        else:
            assert plan.decode_worker is not None
            decode = self._by_id[plan.decode_worker]
            req.decode_worker = decode
            decode.reserved[req.request_id] = req
            decode.mark_dirty()
        if self.prefix_caching:
            hit = self._cached_prefix_tokens(prefill, req)
            req.prefill_left = req.prefill_total = max(1, req.input_len - hit)
        prefill.enqueue_prefill(req, now_s)

    def _fail(self, req: SimRequest, error: str, now_s: float) -> None:
        self.num_rejected += 1
        self.records.append(
            RequestRecord(req.request_id, False, req.arrival_s, status=429, error=error)
        )
        self._send_next(now_s)

    # ---- worker callbacks ---------------------------------------------------------
    def _on_prefilled(self, worker: SimWorker, req: SimRequest, now_s: float) -> None:
        if self.prefix_caching:
            self._cache_insert(worker, req)
        decode = req.decode_worker
        if decode is None or decode is worker:
            worker.join_colocated(req)
            return
        # Decode pulls over its inbound link; transfers to one worker queue on it.
        link = self.profile.transfer
        wire_s = req.input_len * self.profile.kv_bytes_per_token / link.bandwidth_bytes_per_s
        start_s = max(now_s, self._link_free_s[decode.worker_id])
        self._link_free_s[decode.worker_id] = start_s + wire_s
        self._push(start_s + wire_s + link.latency_s, _LANDED, req, 0)

    def _on_finished(self, worker: SimWorker, req: SimRequest, now_s: float) -> None:
        if self.prefix_caching and req.output_len <= 1:
            self._cache_insert(worker, req)
        req.decode_worker = None
        worker.reserved.pop(req.request_id, None)
        self._history.append(req.output_len)
        self._history_view = ()
        assert req.ttft_s is not None
        if req.predicted_ttft_s is not None:
            self.ttft_predictions.append((req.predicted_ttft_s, req.ttft_s - req.arrival_s))
        self.records.append(
            RequestRecord(
                req.request_id,
                True,
                req.arrival_s,
                ttft_s=req.ttft_s - req.arrival_s,
                e2el_s=now_s - req.arrival_s,
                prompt_tokens=req.input_len,
                output_tokens=req.output_len,
                status=200,
            )
        )
        self._send_next(now_s)

    def _on_step(self, worker: SimWorker, now_s: float, sample: StepSample, steps: int) -> None:
        # Every decode sequence waited one step per token: pooled ITL with weights.
        if sample.num_decode_seqs:
            self.itl_values_s.append(sample.duration_s)
            self.itl_weights.append(float(steps * sample.num_decode_seqs))
        self._steps[worker.worker_id].append(sample)

    # ---- prefix cache --------------------------------------------------------------
    def _cached_prefix_tokens(self, worker: SimWorker, req: SimRequest) -> int:
        cache = self._caches[worker.worker_id]
        hits = 0
        for h in req.hash_ids:
            if h not in cache:
                break
            hits += 1
        return hits * self._block_tokens(req)

    def _block_tokens(self, req: SimRequest) -> int:
        return req.input_len // len(req.hash_ids) if req.hash_ids else 0

    def _cache_insert(self, worker: SimWorker, req: SimRequest) -> None:
        cache = self._caches[worker.worker_id]
        for h in req.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        limit = max(1, worker.capacity_tokens // max(1, self._block_tokens(req)))
        while len(cache) > limit:
            cache.popitem(last=False)
        worker.mark_dirty()

    # ---- views ----------------------------------------------------------------------
    def _cluster_view(self, now_s: float) -> ClusterView:
        views = self._views
        for worker in self._dirty:
            views[self._index[worker.worker_id]] = self._worker_view(worker, now_s)
            worker.dirty = False
        self._dirty.clear()
        if not self._history_view and self._history:
            self._history_view = tuple(self._history)
        return ClusterView(tuple(views), self._history_view)  # type: ignore[arg-type]

    def _worker_view(self, w: SimWorker, now_s: float) -> WorkerView:
        k = w.progress_at(now_s)
        running = [_running(r.held + k, r.generated + k, r.max_tokens) for r in w.running]
        reserved_tokens = 0
        for r in w.reserved.values():
            if r.decode_worker is w or r.decode_worker is None:  # None: colocated here
                running.append(_running(r.input_len, r.generated, r.max_tokens))
                reserved_tokens += r.input_len
        free_tokens = w.capacity_tokens - w.used_tokens - reserved_tokens
        bs = self.profile.block_size
        return WorkerView(
            worker_id=w.worker_id,
            role=w.role,
            num_total_blocks=self.profile.num_kv_blocks,
            num_free_blocks=max(0, free_tokens // bs),
            block_size=bs,
            queued_tokens=dict(w.queued_tokens),
            queued_requests={c: len(q) for c, q in w.queues.items()},
            running=tuple(running),
            recent_steps=tuple(self._steps[w.worker_id]),
            prefix_digest=frozenset(self._caches[w.worker_id])
            if self.prefix_caching
            else frozenset(),
            link_bandwidth_bytes_per_s=self.profile.transfer.bandwidth_bytes_per_s,
            kv_bytes_per_token=self.profile.kv_bytes_per_token,
            max_num_seqs=self.profile.max_num_seqs,
            prefill_budget_tokens=w.budget_tokens,
        )
