"""The simulator's telemetry: what each report carries, and no report that says nothing.

A report's running set is rebuilt only when it moved (a step, an admission, a
preemption), so the router's per-running-set caches see the same tuple; and a
report identical to the last one the router took (a decode worker whose KV
landed before its next step) is not sent, as it would only rebuild the same row.
"""

from __future__ import annotations

import pytest

from loadgen.arrivals import RateSpec
from loadgen.scenario import WorkloadConfig, build_requests
from loadgen.sim.cluster import SimCluster
from loadgen.sim.profile import load_profile
from loadgen.sim.telemetry import Reports, SimReport
from loadgen.sim.worker import SimWorker
from router.front_door import Router, RouterSettings, WorkerReport
from router.types import SLO, Role


class _RecordingRouter(Router):
    def __init__(self, settings: RouterSettings) -> None:
        super().__init__(settings)
        self.reports: list[SimReport] = []

    def update(self, report: WorkerReport) -> None:
        assert isinstance(report, SimReport)
        self.reports.append(report)
        super().update(report)


def _run() -> tuple[SimCluster, _RecordingRouter]:
    profile = load_profile()
    router = _RecordingRouter(RouterSettings(profile=profile))
    roles = [Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE]
    cluster = SimCluster(profile, router, roles, SLO(2.0, 0.2))
    workload = WorkloadConfig(
        input_len="lognormal:mean=300,sigma=1.0",
        output_len="lognormal:mean=60,sigma=1.0",
        num_requests=300,
        seed=3,
    )
    cluster.run_open_loop(build_requests(workload, RateSpec(40.0)))
    return cluster, router


def _state(r: SimReport) -> tuple[object, ...]:
    return (
        r.running,
        r.num_free_blocks,
        r.waiting_prompt_lens,
        r.recent_steps,
        r.prefix_digest,
        r.role,
        r.draining,
        r.prefill_budget_tokens,
        r.long_prefill_tokens,
    )


def test_a_worker_never_sends_the_router_what_it_already_has() -> None:
    cluster, router = _run()
    assert len(cluster.records) == 300
    last: dict[str, SimReport] = {}
    for report in router.reports:
        before = last.get(report.worker_id)
        if before is not None:
            assert report.seq > before.seq
            assert _state(report) != _state(before), report.worker_id
        last[report.worker_id] = report


def test_an_unmoved_running_set_is_reported_as_the_same_tuple(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[SimReport] = []  # every report built, sent to the router or not
    build = Reports.build

    def logged(self: Reports, w: SimWorker, now_s: float) -> SimReport:
        report = build(self, w, now_s)
        built.append(report)
        return report

    monkeypatch.setattr(Reports, "build", logged)
    profile = load_profile()
    cluster = SimCluster(
        profile, Router(RouterSettings(profile=profile)), [Role.PREFILL, Role.DECODE], SLO(2.0, 0.2)
    )
    workload = WorkloadConfig(
        input_len="lognormal:mean=300,sigma=1.0",
        output_len="lognormal:mean=60,sigma=1.0",
        num_requests=200,
        seed=4,
    )
    cluster.run_open_loop(build_requests(workload, RateSpec(20.0)))
    last: dict[str, SimReport] = {}
    num_same, num_moved = 0, 0
    for report in built:
        before = last.get(report.worker_id)
        if before is not None and report.running:
            if report.running == before.running:
                assert report.running is before.running
                num_same += 1
            else:
                num_moved += 1
        last[report.worker_id] = report
    assert num_same > 0 and num_moved > 0
