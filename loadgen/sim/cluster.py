"""The discrete-event cluster: arrivals, the REAL router front door, workers, KV links.

Event loop (one heap, ordered by time then sequence number)::

    ARRIVAL    a request reaches the gateway  -> router.place(profile, now)
    RETRY      a held request asks again      -> router.place(...)
    STEP_END   a worker's step/segment ends   -> tokens advance, finishes recorded
    LANDED     a KV transfer completes        -> decode worker may admit it
    ENCODED    an encode worker's encode (FIFO per worker: encoders.py) and the embeddings' pull
               are done -> the request joins its prefill worker's queue once its
               last part has landed (a plan may split the images over several
               encode workers, which encode their parts at once); a request
               with images and no encode worker is encoded by its prefill worker,
               in its first prefill step
    REBALANCE  every rebalance_interval_s     -> router.plan_flip(now): drain one worker
                                                 (none to mixed: it keeps its work)
    FLIPPED    a drained worker's flip is done (flip_latency_s later) -> its new role

The simulator drives ``router.Router`` exactly as the gateway does: a worker whose
state changed is reported (``update``) before the next decision; a plan is reserved
by the router until each worker counts the request (``release(id, worker)``: the
prefill worker as soon as it is queued there, the decode worker when it admits it);
``release(id)`` when the request ends; finished pulls go to ``observe_transfer`` and
output lengths to ``observe_outcome``. A decision costs what it costs live: the
router rebuilds only the reported workers' views.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import replace

from loadgen.metrics import RequestRecord
from loadgen.sim.encoders import EncodeQueues, Encoding
from loadgen.sim.images import ImageTokens
from loadgen.sim.prefix_cache import PrefixCaches
from loadgen.sim.profile import Profile
from loadgen.sim.request import SimRequest
from loadgen.sim.telemetry import Reports
from loadgen.sim.worker import Admission, SimWorker
from loadgen.workload import RequestSpec
from router.front_door import Hold, Router
from router.types import SLO, Plan, RequestProfile, Role, StepSample

__all__ = ["SimCluster"]

_ARRIVAL, _RETRY, _STEP_END, _LANDED, _REBALANCE, _FLIPPED, _ENCODED = range(7)
_PROGRESS_EVERY = 50_000  # events between progress calls (a few per second of CPU)


class SimCluster:
    def __init__(
        self,
        profile: Profile,
        router: Router,
        roles: list[Role],
        slo: SLO,
        prefill_budget_tokens: int = 8192,
        chunk_tokens: int = 512,
        prefix_caching: bool = False,
        hold_poll_s: float = 0.05,
        max_tokens: int | None = None,
        make_admission: Callable[[], Admission] | None = None,
        rebalance: bool = False,
        flip_latency_s: float = 0.5,
        image_tokens: ImageTokens | None = None,
        progress: Callable[[int, int, float], None] | None = None,
        long_prefill_tokens: int = 0,
    ) -> None:
        self.profile = profile
        # Called every ``_PROGRESS_EVERY`` events with (requests finished, requests in
        # all, simulated seconds).
        self._progress = progress
        self._num_requests = 0
        self.image_tokens = image_tokens or ImageTokens(0)
        self._encoders = EncodeQueues(profile)
        self.router = router
        self.slo = slo
        self.prefix_caching = prefix_caching
        self.max_hold_s = router.settings.max_hold_s  # the gateway's backstop, as live
        self.hold_poll_s = hold_poll_s
        self.max_tokens = max_tokens
        self.prefill_budget_tokens = prefill_budget_tokens
        self.chunk_tokens = chunk_tokens
        self.long_prefill_tokens = long_prefill_tokens  # the engines' threshold (0: none)
        self.make_admission = make_admission
        self.flip_latency_s = flip_latency_s
        self._dirty: list[SimWorker] = []
        self.workers = [self._new_worker(f"{role.value}-{i}", role) for i, role in enumerate(roles)]
        self._by_id = {w.worker_id: w for w in self.workers}
        self._prefixes = PrefixCaches(w.worker_id for w in self.workers)
        self._reports = Reports(profile, (w.worker_id for w in self.workers), self._prefixes)
        self._link_free_s: dict[str, float] = {w.worker_id: 0.0 for w in self.workers}
        self._heap: list[tuple[float, int, int, object, int]] = []
        self._event_seq = 0
        self._rebalance = rebalance and router.pressure() is not None
        self._flipping: tuple[SimWorker, Role] | None = None  # draining toward a new role
        self._flip_due = False  # its drain is over; FLIPPED is scheduled
        self.records: list[RequestRecord] = []
        self.itl_values_s: list[float] = []
        self.itl_weights: list[float] = []
        self.num_events = 0
        self.num_decisions = 0
        self.num_rejected = 0
        self.flips: list[tuple[float, str, Role]] = []  # (when done, worker, new role)
        # (router's predicted TTFT, simulated TTFT) per served request, where the policy predicts.
        self.ttft_predictions: list[tuple[float, float]] = []
        self._pending: Iterator[RequestSpec] | None = None  # closed loop: next to send

    def _new_worker(self, worker_id: str, role: Role) -> SimWorker:
        return SimWorker(
            worker_id,
            role,
            self._worker_profile(role),
            self.prefill_budget_tokens if role is Role.PREFILL else self.chunk_tokens,
            self._schedule_step,
            self._on_prefilled,
            self._on_finished,
            self._on_admitted,
            self._on_step,
            self._dirty,
            self.make_admission() if self.make_admission and role is not Role.PREFILL else None,
            self.long_prefill_tokens,
        )

    def _worker_profile(self, role: Role) -> Profile:
        """A decode worker never encodes here (no recompute after preemption is
        modelled): without the vision weights, their memory holds KV blocks too."""
        prof = self.profile
        if role is not Role.DECODE or not prof.vision_kv_blocks:
            return prof
        return replace(prof, num_kv_blocks=prof.num_kv_blocks + prof.vision_kv_blocks)

    # ---- driving ------------------------------------------------------------
    def run_open_loop(self, specs: list[RequestSpec]) -> None:
        self._num_requests = len(specs)
        for spec in specs:
            self._push(spec.arrival_s, _ARRIVAL, self._new_request(spec, spec.arrival_s), 0)
        self._start_rebalancing(specs[0].arrival_s if specs else 0.0)
        self._loop()

    def run_closed_loop(self, specs: list[RequestSpec], concurrency: int) -> None:
        self._num_requests = len(specs)
        self._pending = iter(specs)
        for _ in range(concurrency):
            self._send_next(0.0)
        self._start_rebalancing(0.0)
        self._loop()

    def _send_next(self, now_s: float) -> None:
        if self._pending is None:
            return
        spec = next(self._pending, None)
        if spec is not None:
            self._push(now_s, _ARRIVAL, self._new_request(spec, now_s), 0)

    def _new_request(self, spec: RequestSpec, arrival_s: float) -> SimRequest:
        max_tokens = self.max_tokens if self.max_tokens is not None else spec.output_len
        rule = self.image_tokens
        image_tokens = tuple(map(rule.of_square, spec.image_sides)) if rule.per_tile else ()
        return SimRequest(
            spec.request_id,
            arrival_s,
            spec.input_len + sum(image_tokens),
            spec.output_len,
            max(max_tokens, spec.output_len),
            spec.hash_ids if self.prefix_caching else (),
            image_tokens,
        )

    def _loop(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        progress = self._progress
        while heap:
            now_s, _, kind, payload, version = pop(heap)
            self.num_events += 1
            if progress is not None and not self.num_events % _PROGRESS_EVERY:
                progress(len(self.records), self._num_requests, now_s)
            if kind == _STEP_END:
                worker = payload
                assert isinstance(worker, SimWorker)
                if version == worker.version:
                    worker.end_step(now_s)
                    if worker.draining:
                        self._maybe_flip(worker, now_s)
            elif kind == _LANDED:
                assert isinstance(payload, SimRequest)
                self._landed(payload, now_s)
            elif kind == _REBALANCE:
                self._rebalance_tick(now_s)
            elif kind == _FLIPPED:
                assert isinstance(payload, SimWorker)
                self._flipped(payload, now_s)
            elif kind == _ENCODED:
                assert isinstance(payload, Encoding)
                self._encoded(payload, now_s)
            else:
                assert isinstance(payload, SimRequest)
                self._route(payload, now_s)

    def _push(self, time_s: float, kind: int, payload: object, version: int) -> None:
        self._event_seq += 1
        heapq.heappush(self._heap, (time_s, self._event_seq, kind, payload, version))

    def _schedule_step(self, time_s: float, worker: SimWorker, version: int) -> None:
        self._push(time_s, _STEP_END, worker, version)

    # ---- routing ----------------------------------------------------------------
    def _route(self, req: SimRequest, now_s: float) -> None:
        profile = RequestProfile(
            request_id=req.request_id,
            num_prompt_tokens=req.input_len - req.num_image_tokens,
            num_new_tokens=req.input_len - req.num_image_tokens,
            max_tokens=req.max_tokens,
            num_image_tokens=req.num_image_tokens,
            num_images=len(req.image_tokens),
            image_tokens=req.image_tokens,
            slo=self.slo,
            prefix_hashes=req.hash_ids,
            arrival_s=req.arrival_s,
        )
        self._report_changed(now_s)
        self.num_decisions += 1
        decision = self.router.place(profile, now_s)
        match decision:
            case Plan():
                self._place(req, decision, now_s)
            case Hold() if now_s - req.arrival_s < self.max_hold_s:
                self._push(now_s + min(decision.retry_after_s, self.hold_poll_s), _RETRY, req, 0)
            case _:
                self.router.release(req.request_id)
                self._fail(req, f"rejected: {decision.reason}", now_s)

    def _report_changed(self, now_s: float) -> None:
        """Telemetry: every worker whose state changed since the last decision reports."""
        update = self.router.update
        news = self._reports.news
        for worker in self._dirty:
            report = news(worker, now_s)
            if report is not None:
                update(report)
            worker.dirty = False
        self._dirty.clear()

    def _place(self, req: SimRequest, plan: Plan, now_s: float) -> None:
        prefill = self._by_id[plan.prefill_worker]
        req.prefill_worker = prefill
        if plan.predicted_ttft_s is not None:
            req.predicted_ttft_s = plan.predicted_ttft_s + (now_s - req.arrival_s)
        if plan.colocated:
            req.decode_worker = None
        else:
            assert plan.decode_worker is not None
            decode = self._by_id[plan.decode_worker]
            req.decode_worker = decode
            decode.num_inbound += 1
        if self.prefix_caching:
            hit = self._prefixes.cached_tokens(prefill.worker_id, req)
            req.prefill_left = req.prefill_total = max(1, req.input_len - hit)
        if req.num_image_tokens:
            if plan.encode_worker is not None:
                for encoding in self._encoders.start(req, plan, now_s):
                    self._push(encoding.landed_s, _ENCODED, encoding, 0)
                return
            req.encode_s = self.profile.encode.encode_s(req.num_image_tokens)
        prefill.enqueue_prefill(req, now_s)
        self.router.release(req.request_id, prefill.worker_id)  # its queue counts it now

    def _encoded(self, encoding: Encoding, now_s: float) -> None:
        req, encoder_id, encode_s = encoding.request, encoding.encoder_id, encoding.encode_s
        self.router.release(req.request_id, encoder_id)  # as live: at its first event
        self.router.observe_encode(encoder_id, encoding.num_image_tokens, encode_s)
        if not self._encoders.land(encoding):  # other parts still to land
            return
        prefill = req.prefill_worker
        assert prefill is not None
        prefill.enqueue_prefill(req, now_s)
        self.router.release(req.request_id, prefill.worker_id)

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
        req.transfer_s = wire_s + link.latency_s
        self._push(start_s + req.transfer_s, _LANDED, req, 0)

    def _landed(self, req: SimRequest, now_s: float) -> None:
        decode, prefill = req.decode_worker, req.prefill_worker
        assert decode is not None and prefill is not None
        num_bytes = req.input_len * self.profile.kv_bytes_per_token
        self.router.observe_transfer(prefill.worker_id, decode.worker_id, num_bytes, req.transfer_s)
        decode.enqueue_decode(req, now_s)

    def _on_admitted(self, worker: SimWorker, req: SimRequest, now_s: float) -> None:
        self.router.release(req.request_id, worker.worker_id)  # its running set counts it now

    def _on_finished(self, worker: SimWorker, req: SimRequest, now_s: float) -> None:
        if self.prefix_caching and req.output_len <= 1:
            self._cache_insert(worker, req)
        if req.decode_worker is not None and req.decode_worker is not worker:
            req.decode_worker.num_inbound -= 1  # finished at its first token: never sent
        req.decode_worker = req.prefill_worker = None
        self.router.release(req.request_id)
        self.router.observe_outcome(req.output_len)
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
        self._reports.record_step(worker.worker_id, sample)

    # ---- the P/D ratio rebalancer ------------------------------------------------
    def _start_rebalancing(self, now_s: float) -> None:
        if self._rebalance:
            self._push(now_s + self.router.settings.rebalance_interval_s, _REBALANCE, None, 0)

    def _rebalance_tick(self, now_s: float) -> None:
        """As the gateway's ``Rebalancer``: the router's flip, applied by draining the
        worker (no new plans; what it has finishes), then ``flip_latency_s`` to flip;
        to a role that takes all its work (mixed), ``flip_latency_s`` undrained."""
        if self._flipping is not None:
            self._maybe_flip(self._flipping[0], now_s)
        else:
            self._report_changed(now_s)
            flip = self.router.plan_flip(now_s)
            if flip is not None:
                worker = self._by_id[flip.worker_id]
                self._flipping = (worker, flip.target)
                if not flip.target.does_all_of(flip.source):  # to mixed needs no drain
                    worker.draining = True
                    worker.mark_dirty()
                self._maybe_flip(worker, now_s)
        if self._heap:  # more to simulate: keep ticking
            self._push(now_s + self.router.settings.rebalance_interval_s, _REBALANCE, None, 0)

    def _maybe_flip(self, worker: SimWorker, now_s: float) -> None:
        flipping = self._flipping
        if flipping is None or flipping[0] is not worker or self._flip_due:
            return
        if not worker.draining or worker.is_idle():
            self._flip_due = True
            self._push(now_s + self.flip_latency_s, _FLIPPED, worker, 0)

    def _flipped(self, worker: SimWorker, now_s: float) -> None:
        assert self._flipping is not None
        _, target = self._flipping
        self._flipping, self._flip_due = None, False
        worker.role = target
        worker.draining = False
        worker.budget_tokens = (
            self.prefill_budget_tokens if target is Role.PREFILL else self.chunk_tokens
        )
        if worker.admission is None and self.make_admission and target is not Role.PREFILL:
            worker.admission = self.make_admission()
        worker.mark_dirty()
        self.flips.append((now_s, worker.worker_id, target))

    # ---- prefix cache (loadgen.sim.prefix_cache) ---------------------------------
    def _cache_insert(self, worker: SimWorker, req: SimRequest) -> None:
        self._prefixes.insert(worker.worker_id, req, worker.capacity_tokens)
        worker.mark_dirty()
