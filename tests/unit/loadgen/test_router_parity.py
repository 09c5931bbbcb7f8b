"""One router for the gateway and the simulator: a recorded stream, identical plans.

The simulator runs a workload through ``router.Router`` and every call it makes
(worker reports, placements, releases, transfers, outcomes) is recorded. The same
stream is replayed into the router a ``GatewayService`` builds from the same config
section, the reports entering through the gateway's own telemetry path
(``WorkerSnapshot`` into ``_on_snapshot``) and the requests through the calls its plan
executor makes. Every placement must come out the same: the same settings, view,
reservations, θ and decision, whichever side drives it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from loadgen.arrivals import RateSpec
from loadgen.scenario import WorkloadConfig, build_requests
from loadgen.sim.cluster import SimCluster
from loadgen.sim.profile import load_profile
from loadgen.sim.telemetry import SimReport
from router.front_door import Hold, Router, RouterSettings, WorkerReport
from router.types import SLO, Plan, Reject, RequestProfile, Role
from services.backends.fake import FakeTokenizer
from services.config import ClusterConfig, RouterConfig
from services.gateway.service import GatewayService, GatewaySettings
from services.workers.messages import WorkerSnapshot

Call = tuple[str, tuple[Any, ...], Any]


class RecordingRouter(Router):
    """A real ``Router`` that writes down every call and what it answered."""

    def __init__(self, settings: RouterSettings) -> None:
        super().__init__(settings)
        self.calls: list[Call] = []

    def update(self, report: WorkerReport) -> None:
        self.calls.append(("update", (report,), None))
        super().update(report)

    def place(
        self, profile: RequestProfile, now_s: float, *, replaced: bool = False
    ) -> Plan | Hold | Reject:
        decision = super().place(profile, now_s, replaced=replaced)
        self.calls.append(("place", (profile, now_s), decision))
        return decision

    def release(self, request_id: str, worker_id: str | None = None) -> None:
        self.calls.append(("release", (request_id, worker_id), None))
        super().release(request_id, worker_id)

    def observe_transfer(
        self, prefill_worker: str, decode_worker: str, num_bytes: int, duration_s: float
    ) -> None:
        self.calls.append(
            ("transfer", (prefill_worker, decode_worker, num_bytes, duration_s), None)
        )
        super().observe_transfer(prefill_worker, decode_worker, num_bytes, duration_s)

    def observe_outcome(self, output_len: int) -> None:
        self.calls.append(("outcome", (output_len,), None))
        super().observe_outcome(output_len)


def as_snapshot(r: SimReport) -> WorkerSnapshot:
    """The simulated worker's report as the worker process would send it."""
    return WorkerSnapshot(
        worker_id=r.worker_id, role=r.role, draining=r.draining, seq=r.seq, time_s=0.0,
        block_size=r.block_size, num_total_blocks=r.num_total_blocks,
        num_free_blocks=r.num_free_blocks, num_cached_blocks=0, num_held_blocks=0,
        running=r.running, waiting_prompt_lens=r.waiting_prompt_lens,
        recent_steps=r.recent_steps, recent_output_lens=(), num_preemptions=0,
        num_pending_pulls=0, num_finished_requests=0, kv_bytes_per_token=r.kv_bytes_per_token,
        max_num_seqs=r.max_num_seqs, max_model_len=4096, prefix_digest=r.prefix_digest,
        prefill_budget_tokens=r.prefill_budget_tokens, long_prefill_tokens=r.long_prefill_tokens,
    )  # fmt: skip


@dataclass(frozen=True)
class Recorded:
    calls: list[Call]
    config: RouterConfig


def record_simulation(tmp_path: Path) -> Recorded:
    profile = load_profile()
    seed_file = tmp_path / "profile.json"
    seed_file.write_text(json.dumps(asdict(profile)))
    config = RouterConfig(policy="slo_goodput", profile=str(seed_file), rebalance_interval_s=1.0)
    router = RecordingRouter(RouterSettings.from_config(config))
    cluster = SimCluster(
        profile,
        router,
        [Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE, Role.MIXED],
        SLO(ttft_s=0.3, tpot_s=0.05),
        rebalance=True,
    )
    workload = WorkloadConfig(
        input_len="mix:0.8*uniform:16-200,0.2*uniform:600-1500",
        output_len="uniform:1-60",
        num_requests=300,
        seed=3,
    )
    cluster.run_open_loop(build_requests(workload, RateSpec(400.0)))
    return Recorded(router.calls, config)


def gateway_with(config: RouterConfig) -> GatewayService:
    served = ClusterConfig(router=config)
    settings = GatewaySettings(served.gateway, served.router, served.model, "local")
    return GatewayService(settings, FakeTokenizer(), [], None)  # type: ignore[arg-type]


def test_the_gateway_and_the_simulator_make_the_same_plans(tmp_path: Path) -> None:
    recorded = record_simulation(tmp_path)
    kinds = [kind for kind, _, _ in recorded.calls]
    decisions = [answer for kind, _, answer in recorded.calls if kind == "place"]
    # The stream exercises what matters: interleaved reports, plans of both kinds,
    # holds (a re-placed request), per-worker releases and measured transfers.
    assert kinds.count("update") > 300 and kinds.count("transfer") > 50
    assert any(isinstance(d, Plan) and d.colocated for d in decisions)
    assert any(isinstance(d, Plan) and not d.colocated for d in decisions)
    assert any(isinstance(d, Hold) for d in decisions)
    assert any(isinstance(d, Reject) for d in decisions)

    svc = gateway_with(recorded.config)
    router = svc.router
    assert router.settings == RouterSettings.from_config(recorded.config)
    for kind, args, answer in recorded.calls:
        match kind:
            case "update":
                svc._on_snapshot(as_snapshot(args[0]))  # the gateway's telemetry path
            case "place":
                assert router.place(*args) == answer, args[0].request_id
            case "release":
                router.release(*args)
            case "transfer":
                router.observe_transfer(*args)
            case "outcome":
                router.observe_outcome(*args)
    assert router.classifier.threshold_tokens != router.classifier.knee_tokens  # θ moved


@pytest.mark.parametrize("drift", ["length_split", "threshold"])
def test_a_router_built_differently_plans_differently(tmp_path: Path, drift: str) -> None:
    """The parity above can fail: a gateway configured otherwise diverges."""
    recorded = record_simulation(tmp_path)
    changed = {
        "length_split": {"length_split": "temporal"},
        "threshold": {"length_threshold_tokens": 512},
    }
    svc = gateway_with(recorded.config.model_copy(update=changed[drift]))
    differ = 0
    for kind, args, answer in recorded.calls:
        match kind:
            case "update":
                svc._on_snapshot(as_snapshot(args[0]))
            case "place":
                differ += svc.router.place(*args) != answer
            case "release":
                svc.router.release(*args)
            case "transfer":
                svc.router.observe_transfer(*args)
            case "outcome":
                svc.router.observe_outcome(*args)
    assert differ > 0
