"""``simulate(config) -> summary``: build the cluster, replay the workload, summarise.

The summary has the same keys as ``baton bench`` (see loadgen.metrics) plus
the simulator's own: ``rejected``, ``preempted``, ``num_events``,
``sim_wall_s`` and the cluster shape, so live and simulated runs compare
with ``baton bench --compare``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO, RequestRecord, compute_summary
from loadgen.scenario import WorkloadConfig, build_requests
from loadgen.sim.cluster import SimCluster
from loadgen.sim.images import ImageTokens
from loadgen.sim.profile import Profile, load_profile
from loadgen.workload import RequestSpec, WorkloadError
from router.estimator import PastFutureAdmission
from router.front_door import Router, RouterSettings
from router.types import SLO, Role

__all__ = ["SimConfig", "SimResult", "simulate", "simulate_specs"]


@dataclass(frozen=True)
class SimConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rate: RateSpec | None = None  # None: closed loop at ``concurrency``
    concurrency: int | None = None
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0  # > 0: an aggregated cluster of MIXED workers only
    num_mixed: int = 0  # MIXED workers added to a prefill/decode cluster
    num_encode: int = 0  # ENCODE workers added to a prefill/decode cluster
    image_tokens_per_image: int = 576  # placeholders per image (LLaVA-1.5: 576), or per tile
    # Tiled images (loadgen.sim.images): tiles of this side, at most ``max_image_tiles``
    # and a thumbnail (InternVL2: 448 px, 12); None: one fixed count per image.
    image_tile_px: int | None = None
    max_image_tiles: int = 12
    # The router as ``baton serve`` builds it (``RouterSettings.from_config`` of the same
    # config file); None: RouterConfig's defaults, seeded with ``profile``.
    router: RouterSettings | None = None
    policy: str | None = None  # overrides the router settings' policy
    profile: Profile | None = None  # the simulated hardware; None: the shipped tiny-cpu
    slo: GoodputSLO | None = None
    prefill_budget_tokens: int = 8192
    chunk_tokens: int = 512
    long_prefill_tokens: int = 0  # the engines' long_prefill_token_threshold (0: none)
    max_tokens: int | None = None  # what the router is told; None: the true output length
    admission: str = (
        "past_future"  # decode admission: past_future (the router's estimator) or greedy
    )
    prior_output_len: int = 1024  # the estimator's pessimistic prior
    rebalance: bool = True  # the P/D ratio rebalancer, as served (policies with pressure)
    flip_latency_s: float = 0.5  # from a drained worker to its new role
    # Called now and then with (requests finished, requests in all, simulated seconds).
    progress: Callable[[int, int, float], None] | None = None

    def router_settings(self, profile: Profile) -> RouterSettings:
        settings = self.router or RouterSettings(profile=profile)
        if self.policy is not None:
            settings = replace(settings, policy=self.policy)
        return settings


@dataclass(frozen=True)
class SimResult:
    summary: dict[str, Any]
    records: list[RequestRecord]


def simulate(config: SimConfig) -> SimResult:
    return simulate_specs(config, build_requests(config.workload, config.rate))


def simulate_specs(config: SimConfig, specs: list[RequestSpec]) -> SimResult:
    profile = config.profile or load_profile()
    if config.rate is None and not config.concurrency:
        raise WorkloadError("give a rate or a concurrency")
    _check_counts(config)
    roles = _roles(config)
    slo = config.slo or GoodputSLO()
    settings = config.router_settings(profile)
    cluster = SimCluster(
        profile,
        Router(settings),
        roles,
        SLO(
            ttft_s=slo.ttft_ms / 1000 if slo.ttft_ms is not None else None,
            tpot_s=slo.tpot_ms / 1000 if slo.tpot_ms is not None else None,
        ),
        prefill_budget_tokens=config.prefill_budget_tokens,
        chunk_tokens=config.chunk_tokens,
        prefix_caching=_shares_prefixes(specs),
        max_tokens=config.max_tokens,
        make_admission=_admission_factory(config),
        rebalance=config.rebalance,
        flip_latency_s=config.flip_latency_s,
        image_tokens=ImageTokens(
            config.image_tokens_per_image, config.image_tile_px, config.max_image_tiles
        ),
        progress=config.progress,
        long_prefill_tokens=config.long_prefill_tokens,
    )
    started, started_cpu = time.perf_counter(), time.process_time()
    if config.rate is None:
        assert config.concurrency is not None
        cluster.run_closed_loop(specs, config.concurrency)
    else:
        cluster.run_open_loop(specs)
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - started_cpu
    records = cluster.records
    end_s = max((r.start_s + (r.e2el_s or 0.0) for r in records), default=0.0)
    start_s = min((r.start_s for r in records), default=0.0)
    summary = compute_summary(
        records,
        end_s - start_s,
        config.slo,
        itl_override=(np.asarray(cluster.itl_values_s), np.asarray(cluster.itl_weights)),
    )
    summary |= {
        "mode": "simulate",
        "policy": "aggregated" if config.num_colocated else settings.policy,
        "router_policy": settings.policy,
        "length_split": settings.length_split,
        "router_profile": f"{settings.profile.model} on {settings.profile.hardware}",
        "role_flips": len(cluster.flips),
        "num_prefill": roles.count(Role.PREFILL),
        "num_decode": roles.count(Role.DECODE),
        "num_colocated": roles.count(Role.MIXED),
        "num_encode": roles.count(Role.ENCODE),
        "gpus": len(roles),
        "rate": config.rate.label if config.rate else None,
        "concurrency": config.concurrency,
        "burstiness": config.workload.burstiness,
        "num_requests": len(specs),
        "profile": f"{profile.model} on {profile.hardware}",
        "rejected": cluster.num_rejected,
        "preempted": sum(w.num_preempted for w in cluster.workers),
        "admission": config.admission,
        "num_events": cluster.num_events,
        "num_decisions": cluster.num_decisions,
        **_prediction_error(cluster.ttft_predictions),
        "sim_wall_s": wall_s,
        "sim_cpu_s": cpu_s,  # wall_s on a machine shared with others, less their share
    }
    return SimResult(summary, records)


def _prediction_error(pairs: list[tuple[float, float]]) -> dict[str, float | None]:
    """How the router's predicted TTFT compares with the simulated one, per served request:
    the median and p90 of actual − predicted (ms) and the share under-predicted."""
    if not pairs:
        return {"ttft_pred_err_p50_ms": None, "ttft_pred_err_p90_ms": None, "ttft_under": None}
    err_ms = np.array([actual - pred for pred, actual in pairs]) * 1000
    return {
        "ttft_pred_err_p50_ms": float(np.percentile(err_ms, 50)),
        "ttft_pred_err_p90_ms": float(np.percentile(err_ms, 90)),
        "ttft_under": float(np.mean(err_ms > 0)),
    }


def _admission_factory(config: SimConfig) -> Callable[[], PastFutureAdmission] | None:
    match config.admission:
        case "greedy":
            return None
        case "past_future":
            return lambda: PastFutureAdmission(config.prior_output_len, seed=config.workload.seed)
        case other:
            raise WorkloadError(f"unknown admission {other!r}: past_future or greedy")


def _check_counts(config: SimConfig) -> None:
    """Each count and size in its range, naming the ``baton simulate`` flag (a
    ``WorkloadError``): a negative worker count or a zero chunk used to run anyway."""
    at_least = {
        "--colocated": (config.num_colocated, 0),
        "--mixed": (config.num_mixed, 0),
        "--encode": (config.num_encode, 0),
        "--chunk-tokens": (config.chunk_tokens, 1),
        "--prefill-budget": (config.prefill_budget_tokens, 1),
        "--long-prefill-tokens": (config.long_prefill_tokens, 0),
        "--max-tokens": (1 if config.max_tokens is None else config.max_tokens, 1),
    }
    for flag, (value, low) in at_least.items():
        if value < low:
            raise WorkloadError(f"{flag} must be >= {low}, got {value}")
    if not 0 <= config.flip_latency_s < math.inf:
        raise WorkloadError(f"--flip-latency must be >= 0 seconds, got {config.flip_latency_s}")


def _roles(config: SimConfig) -> list[Role]:
    if config.num_colocated:
        return [Role.MIXED] * config.num_colocated
    if config.num_prefill < 1 or config.num_decode < 1:
        raise WorkloadError("need --prefill >= 1 and --decode >= 1, or --colocated N")
    roles = [Role.PREFILL] * config.num_prefill + [Role.DECODE] * config.num_decode
    return roles + [Role.MIXED] * config.num_mixed + [Role.ENCODE] * config.num_encode


def _shares_prefixes(specs: list[RequestSpec]) -> bool:
    # Only model prefix caches when some block is shared: tracking caches of
    # never-shared blocks costs time and changes nothing.
    counts = Counter(h for s in specs for h in s.hash_ids[:1])
    return any(n > 1 for n in counts.values())
