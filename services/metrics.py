"""Baton's Prometheus metrics, all ``baton_``-prefixed, built on a given registry.

The gateway owns one ``BatonMetrics``; worker gauges are filled from the
telemetry snapshots the gateway receives, so one ``/metrics`` shows the cluster.
The Grafana dashboard and alert rules in deploy/ query only names defined here
(a test checks it against a live registry).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["STAGES", "BatonMetrics"]

STAGES = ("queue", "encode", "prefill", "transfer", "decode")

_LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_TOKEN_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
_DECISION_BUCKETS_S = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2)


class BatonMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # Per-request latency.
        self.ttft_s = Histogram(
            "baton_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot_s = Histogram(
            "baton_time_per_output_token_seconds",
            "Mean time per output token after the first",
            ["model"],
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.itl_s = Histogram(
            "baton_inter_token_latency_seconds",
            "Latency between streamed tokens",
            ["model"],
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "baton_e2e_request_latency_seconds",
            "End-to-end request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.stage_s = Histogram(
            "baton_request_stage_seconds",
            "Per-request waterfall: time spent in each stage",
            ["stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.requests = Counter(
            "baton_requests",
            "Finished requests by outcome (success, error, rejected, aborted); one a choice: "
            "a request with n choices runs n on the workers and counts n",
            ["model", "outcome"],
            registry=r,
        )
        self.slo = Counter(
            "baton_request_slo",
            "Successful requests that met (or missed) their TTFT and TPOT targets",
            ["result"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "baton_prompt_tokens",
            "Prompt tokens processed, once a choice (usage counts a request's prompt once)",
            ["model"],
            registry=r,
        )
        self.prompt_cached_tokens = Counter(
            "baton_prompt_cached_tokens",
            "Prompt tokens served from a prefix cache, once a choice (as baton_prompt_tokens)",
            ["model"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "baton_generation_tokens", "Tokens generated", ["model"], registry=r
        )
        self.inflight = Gauge(
            "baton_gateway_inflight_requests", "Requests in flight at the gateway", registry=r
        )
        # KV transfer.
        self.transfer_bytes = Counter(
            "baton_kv_transfer_bytes", "Bytes of KV moved between workers", ["backend"], registry=r
        )
        self.transfer_s = Histogram(
            "baton_kv_transfer_seconds",
            "Duration of one request's KV pull",
            ["backend"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.transfer_failures = Counter(
            "baton_kv_transfer_failures", "KV pulls that ended FAILED", ["backend"], registry=r
        )
        # Router.
        self.decision_s = Histogram(
            "baton_router_decision_seconds",
            "Time the router takes to plan one request",
            ["policy"],
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.rejections = Counter(
            "baton_router_rejections",
            "Requests rejected early by the router",
            ["reason", "priority"],
            registry=r,
        )
        self.admission_share = Gauge(
            "baton_router_admission_share",
            "Share of each latency target (ttft, tpot) that admission lets predictions use: "
            "it falls while admitted requests miss that target and recovers as they meet it",
            ["target"],
            registry=r,
        )
        self.retries = Counter(
            "baton_request_retries",
            "Requests re-planned after a worker failure or a failed transfer",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "baton_request_migrations", "Requests migrated between decode workers", registry=r
        )
        self.role_changes = Counter(
            "baton_role_changes",
            "Worker role flips by the P/D planner",
            ["from_role", "to_role"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "baton_queue_depth",
            "Requests queued for prefill by length class",
            ["length_class"],
            registry=r,
        )
        # Workers, from telemetry.
        self.kv_blocks = Gauge(
            "baton_worker_kv_blocks",
            "KV blocks per worker by state (used, free, cached, held)",
            ["worker", "role", "state"],
            registry=r,
        )
        self.kv_peak_blocks = Gauge(
            "baton_worker_kv_peak_estimate_blocks",
            "Past-future estimate of the peak KV blocks",
            ["worker"],
            registry=r,
        )
        self.worker_requests = Gauge(
            "baton_worker_requests",
            "Requests per worker by state (running, waiting)",
            ["worker", "role", "state"],
            registry=r,
        )
        self.worker_preemptions = Gauge(
            "baton_worker_preemptions",
            "Preemptions since the worker started",
            ["worker"],
            registry=r,
        )
        self.worker_images = Gauge(
            "baton_worker_images",
            "Images since the worker started, by how their embeddings came "
            "(encoded, or cached: the encoder-output cache)",
            ["worker", "source"],
            registry=r,
        )
        self.workers = Gauge(
            "baton_workers",
            "Workers by role and state (alive, dead)",
            ["role", "state"],
            registry=r,
        )
        # Per API key, labelled by the key's name (never the key).
        self.key_requests = Counter(
            "baton_key_requests", "Requests admitted per API key", ["key"], registry=r
        )
        self.key_rate_limited = Counter(
            "baton_key_rate_limited",
            "Requests refused with 429 per API key and limit (requests, tokens, concurrency)",
            ["key", "limit"],
            registry=r,
        )
        self.key_prompt_tokens = Counter(
            "baton_key_prompt_tokens", "Prompt tokens per API key", ["key"], registry=r
        )
        self.key_generation_tokens = Counter(
            "baton_key_generation_tokens", "Tokens generated per API key", ["key"], registry=r
        )
        self.key_inflight = Gauge(
            "baton_key_inflight_requests", "Requests in flight per API key", ["key"], registry=r
        )
