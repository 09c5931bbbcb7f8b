"""``slo_goodput`` (the default): place each request where it meets TTFT and TPOT at least cost.

For a request of effective prefill length ``n`` (per worker: its own prefix hit):

1. *Prefill side*, every prefill worker ``P``:
   ``TTFT_P = wait(class of n) + prefill(n) + encode`` and, disaggregated, plus
   ``transfer = n_total·kv_bytes_per_token / min(bandwidth_P, bandwidth_D)
   + max(latency_P, latency_D)`` (each worker's link as measured, else the profile's).
   The prefill worker of a disaggregated plan is the one with the least
   ``TTFT_P + n_total·kv_bytes_per_token / bandwidth_P``.
2. *Decode side*, every decode worker ``D``: room for one more sequence, the
   decode step with the request added within TPOT, the pair's TTFT within what
   is left of the TTFT target, and the past-future peak with the request
   added under the memory limit. Among the feasible, the EMPTIEST (lowest
   estimated peak / limit) wins. The peak is a forecast from the lengths of
   finished requests: packing the fullest worker up to the limit (best fit, to
   leave idle workers to release) turns each under-forecast into a preemption
   (memory-bound run of ``benchmarks/policies.py``, outputs 1k-4k unknown to the
   router, 45 req/s on 16 GPUs: 0.57 attainment and 705 preemptions against
   least_loaded's 0.999), while spreading keeps every worker's margin (1.0, 0
   preemptions) and its batch, hence its step time, small.
3. *Colocated*, every worker whose role is in ``colocate_roles``: the same
   checks with no transfer; its cost is its TTFT plus ``stall_weight ×
   running requests × prefill(n)`` (the decode steps its prefill delays). A
   disaggregated plan costs its TTFT. The cheaper feasible plan wins; when the
   transfer breaks TTFT only the colocated one is feasible. Under the spatial
   split a long prompt is never colocated while a long prefill pool exists.
4. *Encode* (requests with images): on the prefill worker itself
   (``own = encode(m)`` for ``m`` image tokens, the fitted ``a + b·m`` of
   ``router.encode_fit``), or remotely, where it overlaps the prefill worker's wait.
   Remotely, a request's images may be split over the ``k`` least-queued encode
   workers (contiguous parts cut by image tokens, the largest as small as it can be,
   the larger ones on the less queued: ``router.image_parts``): the parts run at
   once and the encode is ready when the last part lands,
   ``ready_k = max_j (queue_j·b + encode(m_j) + latency_j)`` for part ``j`` of
   ``m_j`` image tokens; ``k`` (1 up to the image count) is the one with the least
   ``ready_k`` (a tie keeps fewer parts: a part on a queued encoder lands later), and
   ``remote = max(0, ready_k − wait_P)``. Remote wins
   for ``P`` when ``remote ≤ 2·own``: an encode on ``P`` also delays every request
   queued behind it there by ``own`` (the stall), which a remote encode does not.
   The plan names the encode worker only when remote won for its prefill worker.
   While encodes are priced at zero (no profile term, nothing fitted yet) the
   encode workers are used: the first remote encodes fit the term.
5. Nothing feasible: an interactive request whose TTFT target is still
   reachable and which has waited less than ``max_hold_s`` is held
   (``Reject(hold=True)``); otherwise it is rejected with a ``Retry-After``,
   and marked not ``retryable`` when its prefill alone, on an idle worker,
   would already miss the target.

Batch requests are shed first: they must fit under ``batch_memory_fraction``
of capacity (lower than interactive's ``memory_fraction``) and within
``batch_slo_headroom`` of each target, and they are never held.

The checks that need only the worker table (colocated TPOT, the decode pick, the
refusal) are ``router.policies.slo_checks``.

Predictions include each worker's recent model error as a margin. The memory
check first uses bounds (the peak with the candidate lies between the peak
without it and that plus ``c_q + max r_q``) and prices exactly only workers in
between, most preferred first, at most ``max_exact_checks`` of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from router.cost_model import CostModel
from router.encode_fit import EncodeFit, price_encode, remote_for
from router.estimator import sample_output_lengths_of_one, sorted_history
from router.length import LengthClassifier, SplitMode
from router.planner import RolePressure
from router.policies.slo_checks import (
    any_true,
    best_prefill_s,
    colocated_tpot_s,
    pick_decode,
    prefill_tokens,
    refusal,
    table_pressure,
)
from router.policy import register_policy
from router.profile import DEFAULT_PROFILE, Profile, load_profile
from router.types import (
    SLO,
    ClusterView,
    Plan,
    Priority,
    Reject,
    RequestProfile,
    Role,
    StepSample,
)
from router.worker_table import ROLE_CODES, TableSettings, WorkerTable

__all__ = ["SloGoodput"]


_CANDIDATE_RING = 64  # pre-drawn candidate lengths, reused cyclically
_DEFAULT_SLO = SLO(ttft_s=2.0, tpot_s=0.2)  # RouterConfig.default_slo's defaults


@register_policy("slo_goodput")
@dataclass
class SloGoodput:
    name: str = "slo_goodput"
    profile: Profile | str | None = None  # a Profile, a profile JSON path, or the default
    default_slo: SLO = _DEFAULT_SLO
    length_split: str = "temporal"  # or "spatial" (RouterConfig.length_split)
    length_threshold_tokens: int | None = None
    memory_fraction: float = 0.95
    batch_memory_fraction: float = 0.8
    slo_headroom: float = 1.0  # interactive requests must fit within this share of each target
    batch_slo_headroom: float = 0.8
    max_hold_s: float = 5.0
    hold_retry_s: float = 0.05
    min_retry_after_s: float = 1.0
    colocate_roles: tuple[Role, ...] = (Role.MIXED, Role.DECODE)
    stall_weight: float = 1.0
    prior_long_share: float = 0.25  # its own classifier's, before any request is seen
    prior_output_len: int = 1024
    history_window: int = 200
    num_draws: int = 5
    max_exact_checks: int = 8
    use_error_margin: bool = True
    seed: int = 0
    # The owner's classifier (``router.Router``'s): the owner observes each request once
    # and this policy only reads θ. None: its own, observed on every ``plan`` call.
    classifier: LengthClassifier | None = None
    _table: WorkerTable = field(init=False, repr=False)
    _classifier: LengthClassifier = field(init=False, repr=False)
    _models: dict[str, CostModel] = field(init=False, repr=False, default_factory=dict)
    _profile: Profile = field(init=False, repr=False)
    _history_source: tuple[int, ...] | None = field(init=False, repr=False, default=None)
    _ring_u: list[list[float]] = field(init=False, repr=False)
    _ring_next: int = field(init=False, repr=False, default=0)
    _mean_output_len: float = field(init=False, repr=False, default=1.0)
    _observes: bool = field(init=False, repr=False, default=True)
    _prefilling_codes: frozenset[int] = field(init=False, repr=False)
    # (profile, the table's workers, per-worker prefill tokens, the fewest), last computed
    _tokens_of: tuple[RequestProfile, Any, np.ndarray | float, float] | None = field(
        init=False, repr=False, default=None
    )
    _spatial: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        match self.profile:
            case Profile():
                self._profile = self.profile
            case str():
                self._profile = load_profile(self.profile)
            case None:
                self._profile = DEFAULT_PROFILE
        rng = np.random.default_rng(self.seed)
        settings = TableSettings(
            profile=self._profile,
            split_mode=SplitMode(self.length_split),
            memory_fraction=self.memory_fraction,
            batch_memory_fraction=self.batch_memory_fraction,
            colocate_roles=tuple(self.colocate_roles),
            use_error_margin=self.use_error_margin,
            num_draws=self.num_draws,
            stall_weight=self.stall_weight,
        )
        self._table = WorkerTable(settings, self.cost_model, rng)
        self._prefilling_codes = frozenset(
            ROLE_CODES[r] for r in (Role.PREFILL, *self.colocate_roles)
        )
        self._observes = self.classifier is None
        self._classifier = self.classifier or LengthClassifier(
            self._profile.prefill,
            self.length_threshold_tokens,
            prior_long_share=self.prior_long_share,
        )
        self._spatial = settings.split_mode is SplitMode.SPATIAL
        self._ring_u = rng.random((_CANDIDATE_RING, self.num_draws)).tolist()
        self._refresh_history(())
        self._encode_fit = EncodeFit(self._profile.encode)

    # -- feeding -----------------------------------------------------------------------

    def cost_model(self, worker_id: str) -> CostModel:
        model = self._models.get(worker_id)
        if model is None:
            model = self._models[worker_id] = CostModel(self._profile)
        return model

    def observe_step(self, worker_id: str, sample: StepSample) -> None:
        """Feed a step directly (telemetry with ``end_s`` set is also read from the view)."""
        self.cost_model(worker_id).observe(sample)

    def observe_encode(self, worker_id: str, num_image_tokens: int, duration_s: float) -> None:
        """An encode worker finished one: the encode term is refitted (one for all)."""
        self._encode_fit.observe(num_image_tokens, duration_s)

    def refresh(self, view: ClusterView) -> None:
        """Bring the per-worker rows up to ``view`` now (e.g. when telemetry arrives),
        so that the next ``plan`` on this view pays only for the decision."""
        lengths = view.recent_output_lens
        if lengths is not self._history_source and lengths != self._history_source:
            self._refresh_history(lengths)
        self._table.sync(view)
        if self._spatial:
            c = self._classifier
            self._table.size_long_pool(c.long_share, c.present_request_shares)

    def pressure(self, view: ClusterView, mean_prompt_tokens: float) -> RolePressure:
        """Each role's load against its target, for the ratio planner
        (``slo_checks.table_pressure``)."""
        self.refresh(view)
        encode_b = self._encode_fit.estimate.b
        return table_pressure(
            self._table, mean_prompt_tokens, self.default_slo, self._mean_output_len, encode_b
        )

    @property
    def length_threshold(self) -> float:
        return self._classifier.threshold_tokens

    def _refresh_history(self, lengths: tuple[int, ...]) -> None:
        self._history_source = lengths
        window = self.history_window
        sorted_h = sorted_history(self.prior_output_len, window, window // 2, lengths)
        self._table.sorted_history = sorted_h
        self._mean_output_len = max(1.0, float(sorted_h.mean()))

    # -- deciding ----------------------------------------------------------------------

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        self.refresh(view)
        t = self._table
        if not view.workers:
            return Reject("no live worker", retry_after_s=self.min_retry_after_s)
        batch = profile.priority is Priority.BATCH
        headroom = self.batch_slo_headroom if batch else self.slo_headroom
        ttft_s = profile.slo.ttft_s or self.default_slo.ttft_s
        tpot_s = profile.slo.tpot_s or self.default_slo.tpot_s
        elapsed_s = max(0.0, now_s - profile.arrival_s)
        budget_s = ttft_s * headroom - elapsed_s if ttft_s is not None else math.inf
        tpot_limit_s = tpot_s * headroom if tpot_s is not None else math.inf

        n, least = self._prefill_tokens(profile)
        if self._observes:
            self._classifier.observe(least)
        is_long = n >= self._classifier.threshold_tokens
        prefill_s = t.pa + n * (t.pb + n * t.pc)
        match is_long:
            case np.ndarray():
                wait_s = np.where(is_long, t.wait_long_s, t.wait_short_s)
            case _:
                wait_s = t.wait_long_s if is_long else t.wait_short_s
        own_encode_s = self._encode_fit.encode_s(profile.num_image_tokens)
        # Encoded remotely, it joins the queue when its images land, behind the prompts
        # placed there whose own images land before (``WorkerTable.encoding_wait_s``).
        landing_wait_s = wait_s
        if profile.num_image_tokens > 0 and any_true(t.encoding_wait_s):
            landing_wait_s = wait_s + t.encoding_wait_s
        encode_s, remote, encode_parts = price_encode(
            t, self._encode_fit, profile, landing_wait_s, own_encode_s
        )
        ttft_local = wait_s + prefill_s
        if profile.num_image_tokens > 0:
            ttft_local = np.where(remote, landing_wait_s, wait_s) + prefill_s + encode_s

        # Decode-side checks shared by both kinds of plan: TPOT with the request added,
        # memory bounds of the past-future peak (see ``pick_decode``).
        held_q = float(profile.num_prompt_tokens + profile.num_image_tokens)
        # A handful of draws: Python floats (the same values) cost less than numpy calls.
        max_tokens = profile.max_tokens
        r_q = [max(min(x, max_tokens) - 1.0, 0.0) for x in self._next_candidate()]
        r_q_max = max(r_q)
        tpot_pred = t.step_base_s + t.step_per_token_s * held_q
        if batch:
            room, slack, limit = t.batch_room_tokens, t.batch_slack_tokens, t.batch_limit_tokens
            decode_ok, coloc_ok = t.batch_decode_ok, t.batch_coloc_ok
        else:
            room, slack, limit = t.room_tokens, t.slack_tokens, t.limit_tokens
            decode_ok, coloc_ok = t.decode_ok, t.coloc_ok
        decodable = (tpot_pred <= tpot_limit_s) & (held_q < room)
        sure = held_q + r_q_max < slack

        # Disaggregated: the best prefill worker, then the emptiest feasible decode worker.
        best: tuple[float, Plan] | None = None
        score = ttft_local + t.transfer_s_per_token * held_q + self._prefill_penalty(t, is_long)
        p = int(score.argmin())
        if score[p] < np.inf:
            kv_bytes = held_q * t.kv_bytes_per_token[p]
            ttft_pair = ttft_local[p] + kv_bytes / np.minimum(t.bandwidth[p], t.bandwidth)
            ttft_pair += np.maximum(t.link_latency_s[p], t.link_latency_s)  # the slower end
            ok = decode_ok & decodable & (ttft_pair <= budget_s)
            # A decode worker's link first carries the KV already reserved there, and the
            # second token waits for it: past one TPOT of queue, a less loaded link wins
            # (with every link past it, the least loaded one).
            link_s = t.inbound_tokens * t.transfer_s_per_token
            short_link = ok & (link_s <= tpot_limit_s)
            if any_true(short_link):
                ok = short_link
            elif any_true(ok):
                ok = ok & (link_s <= link_s[ok].min())
            d = pick_decode(t, ok, sure, -t.fullness, held_q, r_q, limit, self.max_exact_checks)
            if d >= 0:
                best = (float(ttft_pair[d]), self._make_plan(p, d, n, ttft_pair[d], tpot_pred[d]))

        # Colocated: the same checks without a transfer, priced with the decodes it stalls:
        # the mean step of the running sequences with this prompt's chunks among them.
        coloc_tpot_s = colocated_tpot_s(t, n, self._mean_output_len) + t.step_per_token_s * held_q
        ok = (
            coloc_ok
            & decodable
            & (ttft_local <= budget_s)
            & (coloc_tpot_s <= tpot_limit_s)
            & self._may_colocate(t, is_long)
        )
        if any_true(ok):
            cost = ttft_local + t.stall_per_prefill_s * prefill_s
            c = pick_decode(t, ok, sure, -cost, held_q, r_q, limit, self.max_exact_checks)
            if c >= 0 and (best is None or cost[c] < best[0]):
                best = (float(cost[c]), self._make_plan(c, None, n, ttft_local[c], coloc_tpot_s[c]))

        if best is None:
            feasible_decode = decodable & (decode_ok | coloc_ok)
            target_s = ttft_s * headroom if ttft_s is not None else math.inf
            hopeless = best_prefill_s(t, prefill_s + own_encode_s, self.colocate_roles) > target_s
            return refusal(
                t,
                ttft_local,
                feasible_decode,
                budget_s,
                colocate_roles=self.colocate_roles,
                hold=not batch and elapsed_s < self.max_hold_s,
                hold_retry_s=self.hold_retry_s,
                min_retry_after_s=self.min_retry_after_s,
                hopeless=hopeless,
            )
        plan = best[1]
        if not encode_parts or not remote_for(t, plan.prefill_worker, remote):
            return plan
        split = encode_parts if len(encode_parts) > 1 else ()
        return replace(plan, encode_worker=encode_parts[0][0], encode_parts=split)

    def _prefill_penalty(self, t: WorkerTable, is_long: np.ndarray | bool) -> np.ndarray:
        """0 on the prefill workers this request may use, inf elsewhere."""
        if not self._spatial:
            return t.prefill_penalty
        pool = np.where(t.in_long_pool == is_long, t.prefill_penalty, np.inf)
        return pool if any_true(np.isfinite(pool)) else t.prefill_penalty

    def _may_colocate(self, t: WorkerTable, is_long: np.ndarray | bool) -> np.ndarray | bool:
        """Spatial split with a long pool: a long prompt prefills only there (on a
        mixed worker of the pool, colocated), never on another colocated host, where it
        would hold up that host's short prefills; a short one stays out of the pool."""
        if not self._spatial or not any_true(t.in_long_pool):
            return True
        match is_long:
            case np.ndarray():
                return np.where(is_long, t.in_long_pool, t.short_hosts)
            case _:
                return t.in_long_pool if is_long else t.short_hosts

    def least_prefill_tokens(self, profile: RequestProfile, view: ClusterView) -> float:
        """The fewest tokens ``profile`` would prefill on a worker that prefills: all of
        them but its longest cached prefix there (what θ observes, ``router.Router``)."""
        self.refresh(view)
        return self._prefill_tokens(profile)[1]

    def _prefill_tokens(self, profile: RequestProfile) -> tuple[np.ndarray | float, float]:
        """``slo_checks.prefill_tokens``, kept for the ``plan`` of the same request on
        the same rows (the router asks for the fewest first, with
        ``least_prefill_tokens``)."""
        t = self._table
        cached = self._tokens_of
        if cached is not None and cached[0] is profile and cached[1] is t.workers:
            return cached[2], cached[3]
        n, least = prefill_tokens(t, profile, self._prefilling_codes)
        self._tokens_of = (profile, t.workers, n, least)
        return n, least

    def _next_candidate(self) -> list[float]:
        """The next pre-drawn candidate's output lengths against today's H (a new request
        has generated nothing: drawn from all of H, uncapped; its cap is applied by the
        caller). Drawn when used: a new H (every few finished requests) redrew the whole
        ring, 40-70 µs in one decision of eight at 64 workers."""
        u = self._ring_u[self._ring_next]
        self._ring_next = (self._ring_next + 1) % _CANDIDATE_RING
        history = self._table.running_sets.history_floats()
        return sample_output_lengths_of_one(history, 0.0, history[-1] + 1.0, u)

    def _make_plan(
        self, p: int, d: int | None, n: np.ndarray | float, ttft_s: float, tpot_s: float
    ) -> Plan:
        workers = self._table.workers
        assert workers is not None
        n_p = float(n[p]) if isinstance(n, np.ndarray) else n
        return Plan(
            prefill_worker=workers[p].worker_id,
            decode_worker=None if d is None else workers[d].worker_id,
            length_class=self._classifier.classify(n_p),
            predicted_ttft_s=float(ttft_s),
            predicted_tpot_s=float(tpot_s),
        )
