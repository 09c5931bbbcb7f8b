"""The simulator against timelines computed by hand from a simple profile."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO
from loadgen.scenario import WorkloadConfig, build_requests
from loadgen.sim import SimConfig, simulate, simulate_specs
from loadgen.sim.profile import Profile, QuadCoeffs, TransferCoeffs, load_profile
from loadgen.workload import RequestSpec
from router.policy import available_policies, register_policy
from router.types import SLO, ClusterView, Reject, RequestProfile, Role

RR = "round_robin"  # the timelines below are computed for it
PROFILE = Profile(
    model="hand",
    hardware="paper",
    prefill=QuadCoeffs(0.01, 0.001, 0.0),
    decode=QuadCoeffs(0.01, 0.0, 0.0001),
    transfer=TransferCoeffs(bandwidth_bytes_per_s=1e6, latency_s=0.005),
    kv_bytes_per_token=100,
    num_kv_blocks=1000,
    block_size=16,
    max_num_seqs=8,
)


@register_policy("test_reject_all")
@dataclass
class RejectAllFake:
    name: str = "test_reject_all"

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Reject:
        return Reject("full")


def _spec(rid: str, t: float, n_in: int, n_out: int) -> RequestSpec:
    return RequestSpec(rid, t, n_in, n_out)


def _by_id(result):  # type: ignore[no-untyped-def]
    return {r.request_id: r for r in result.records}


def _disagg(**kw) -> SimConfig:  # type: ignore[no-untyped-def]
    kw.setdefault("policy", RR)
    return SimConfig(rate=RateSpec(1.0), profile=PROFILE, num_prefill=1, num_decode=1, **kw)


def test_one_request_prefill_transfer_decode() -> None:
    rec = _by_id(simulate_specs(_disagg(), [_spec("a", 0.0, 100, 5)]))["a"]
    # prefill 0.01 + 100*0.001; transfer 100*100/1e6 + 0.005 lands at 0.125;
    # then 4 decode steps with context 101..104: 0.01 + 0.0001*ctx each.
    assert rec.ttft_s == pytest.approx(0.11)
    assert rec.e2el_s == pytest.approx(0.125 + 4 * 0.01 + 0.0001 * (101 + 102 + 103 + 104))
    assert rec.output_tokens == 5 and rec.success


def test_arrival_mid_segment_joins_at_next_step_boundary() -> None:
    result = simulate_specs(_disagg(), [_spec("a", 0.0, 100, 20), _spec("b", 0.16, 100, 2)])
    rec = _by_id(result)
    # b lands at 0.285; a's segment began at 0.125 and its 8th step ends at
    # 0.125 + 8*0.0201 + 0.0001*28 = 0.2886, where b joins (context 109 + 101).
    b_done = 0.2886 + 0.01 + 0.0001 * 210
    assert rec["b"].e2el_s == pytest.approx(b_done - 0.16)
    # a then runs its 10 remaining tokens alone from context 110.
    assert rec["a"].e2el_s == pytest.approx(b_done + 10 * 0.021 + 0.0001 * 45)


def test_colocated_chunked_prefill() -> None:
    cfg = SimConfig(
        rate=RateSpec(1.0), profile=PROFILE, num_colocated=1, chunk_tokens=64, policy=RR
    )
    rec = _by_id(simulate_specs(cfg, [_spec("a", 0.0, 100, 3)]))["a"]
    # chunks of 64 and 36 tokens, each paying the prefill overhead a
    assert rec.ttft_s == pytest.approx(0.074 + 0.046)
    assert rec.e2el_s == pytest.approx(0.12 + 0.0201 + 0.0202)


def test_long_prefill_threshold_lets_a_short_prompt_past_a_long_one() -> None:
    # a (1000 tokens) runs alone, whole: 0.01 + 1.0 s. c (1000) and b (20) queue behind it.
    specs = [_spec("a", 0.0, 1000, 2), _spec("c", 0.5, 1000, 2), _spec("b", 0.6, 20, 2)]
    capped = _by_id(simulate_specs(_disagg(long_prefill_tokens=100), specs))
    whole = _by_id(simulate_specs(_disagg(), specs))
    for rec in (capped, whole):
        assert rec["a"].ttft_s == pytest.approx(1.01)
    # Capped: c's first 100 tokens and all of b share the step from 1.01 (0.01 + 0.12 s);
    # then c, alone, takes its last 900 in one step (0.01 + 0.9 s).
    assert capped["b"].ttft_s == pytest.approx(1.14 - 0.6)
    assert capped["c"].ttft_s == pytest.approx(1.14 + 0.91 - 0.5)
    # Whole: c's 1000 and b's 20 in one step from 1.01 (0.01 + 1.02 s).
    assert whole["b"].ttft_s == pytest.approx(2.04 - 0.6)
    assert whole["c"].ttft_s == pytest.approx(2.04 - 0.5)


def test_rejections_are_failures_and_lower_attainment() -> None:
    cfg = _disagg(policy="test_reject_all", slo=GoodputSLO(ttft_ms=1000))
    s = simulate_specs(cfg, [_spec("a", 0.0, 10, 2), _spec("b", 0.1, 10, 2)]).summary
    assert (s["completed"], s["failed"], s["rejected"]) == (0, 2, 2)
    assert s["slo_attainment"] == 0.0


def test_memory_pressure_greedy_preempts_estimator_does_not() -> None:
    small = replace(PROFILE, num_kv_blocks=20)  # 320 tokens; 4 x (60 + 80) will not fit
    specs = [_spec(f"r{i}", 0.001 * i, 60, 80) for i in range(4)]
    greedy = SimConfig(
        rate=RateSpec(100.0), profile=small, num_prefill=1, num_decode=1, admission="greedy",
        policy=RR,
    )  # fmt: skip
    s = simulate_specs(greedy, specs).summary
    assert s["completed"] == 4
    assert s["preempted"] > 0
    # The router's past-future estimator as decode admission: nobody is preempted,
    # requests wait for room instead (max_tokens is exact here).
    careful = replace(greedy, admission="past_future")
    s = simulate_specs(careful, specs).summary
    assert s["completed"] == 4
    assert s["preempted"] == 0


def test_closed_loop_runs_one_at_a_time() -> None:
    cfg = SimConfig(
        rate=None, concurrency=1, profile=PROFILE, num_colocated=1, chunk_tokens=512, policy=RR
    )
    result = simulate_specs(cfg, [_spec("a", 0.0, 100, 1), _spec("b", 0.0, 100, 1)])
    rec = _by_id(result)
    assert rec["a"].e2el_s == pytest.approx(0.11)
    assert rec["b"].start_s == pytest.approx(0.11)  # sent when a finished


def test_summary_matches_bench_keys_and_is_reproducible() -> None:
    cfg = SimConfig(
        workload=WorkloadConfig(
            input_len="uniform:50-500", output_len="uniform:5-50", num_requests=300
        ),
        rate=RateSpec(20.0),
        num_prefill=2,
        num_decode=2,
        profile=load_profile(),
        slo=GoodputSLO(ttft_ms=500, tpot_ms=100),
        policy=RR,
    )
    a, b = simulate(cfg).summary, simulate(cfg).summary
    for key in ("completed", "request_goodput", "p99_ttft_ms", "mean_tpot_ms", "median_itl_ms"):
        assert a[key] == b[key]
    assert a["completed"] + a["failed"] == 300
    assert a["gpus"] == 4 and a["policy"] == "round_robin"


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_conserves_requests(policy: str) -> None:
    workload = WorkloadConfig(
        input_len="mix:0.8*uniform:16-200,0.2*uniform:600-1500",
        output_len="uniform:1-60",
        num_requests=200,
        seed=7,
    )
    shapes = ({"num_prefill": 2, "num_decode": 2}, {"num_colocated": 3}, {"num_mixed": 1})
    for shape in shapes:
        cfg = SimConfig(
            workload=workload,
            rate=RateSpec(30.0),
            profile=load_profile(),
            policy=policy,
            slo=GoodputSLO(ttft_ms=2000, tpot_ms=200),
            **shape,  # type: ignore[arg-type]
        )
        result = simulate(cfg)
        assert len(result.records) == 200
        assert len({r.request_id for r in result.records}) == 200
        for r in result.records:
            if r.success:
                assert r.ttft_s is not None and r.e2el_s is not None
                assert 0 < r.ttft_s <= r.e2el_s
        specs = {f"req-{i}" for i in range(200)}
        assert {r.request_id for r in result.records} == specs


def test_shipped_profiles_load_with_sources() -> None:
    tiny = load_profile()
    assert tiny.model == "tiny" and tiny.kv_bytes_per_token == 512
    llama = load_profile("llama3-8b-h100")
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K,V x layers x KV heads x dim x bf16
    assert all(len(p.sources) >= 3 for p in (tiny, llama))


def _prefill_bound(**kw) -> SimConfig:  # type: ignore[no-untyped-def]
    from router.front_door import RouterSettings

    return SimConfig(
        workload=WorkloadConfig(
            input_len="uniform:1500-2000", output_len="uniform:2-8", num_requests=400, seed=1
        ),
        rate=RateSpec(150.0),  # ~5 prefill workers' worth of long prompts
        num_prefill=1,
        num_decode=3,
        router=RouterSettings(profile=load_profile(), rebalance_interval_s=1.0),
        policy="slo_goodput",
        slo=GoodputSLO(ttft_ms=1000, tpot_ms=200),
        **kw,
    )


def test_the_rebalancer_drains_then_flips_a_decode_worker_to_prefill() -> None:
    from loadgen.sim.cluster import SimCluster
    from loadgen.sim.run import _roles
    from router.front_door import Router

    config = _prefill_bound(flip_latency_s=0.25)
    profile = load_profile()
    settings = config.router_settings(profile)
    cluster = SimCluster(profile, Router(settings), _roles(config), SLO(1.0, 0.2), rebalance=True,
                         flip_latency_s=0.25)  # fmt: skip
    cluster.run_open_loop(build_requests(config.workload, config.rate))
    assert cluster.flips, "a prefill-bound cluster never gained a prefill worker"
    done_s, worker_id, role = cluster.flips[0]
    assert worker_id.startswith("decode") and role is Role.PREFILL
    assert done_s >= 1.0 + 0.25  # the first tick, then the flip latency at least
    assert simulate(config).summary["role_flips"] == len(cluster.flips)
    assert simulate(replace(config, rebalance=False)).summary["role_flips"] == 0


def test_a_two_worker_cluster_becomes_two_mixed_under_shifting_traffic_and_serves_more() -> None:
    """1 prefill + 1 decode under decode-light then prefill-heavy then decode-light traffic:
    the lone workers cannot be given to the other role, so the planner pools them (both
    become mixed), and the run's goodput beats the same run with flips off."""
    from loadgen.sim.run import simulate_specs
    from router.front_door import RouterSettings

    rate, seconds = 20.0, 10.0

    def phase(k: int, input_len: str, output_len: str) -> list:  # type: ignore[type-arg]
        workload = WorkloadConfig(
            input_len=input_len, output_len=output_len, num_requests=int(rate * seconds), seed=k
        )
        return [
            replace(s, request_id=f"{k}-{s.request_id}", arrival_s=s.arrival_s + k * seconds)
            for s in build_requests(workload, RateSpec(rate))
        ]

    chat = ("uniform:32-96", "uniform:100-200")
    specs = sorted(
        phase(0, *chat) + phase(1, "uniform:800-1200", "uniform:2-6") + phase(2, *chat),
        key=lambda s: s.arrival_s,
    )
    config = SimConfig(
        rate=RateSpec(rate),
        router=RouterSettings(profile=load_profile(), rebalance_interval_s=seconds / 6),
        policy="slo_goodput",
        slo=GoodputSLO(ttft_ms=1000, tpot_ms=50),
        flip_latency_s=0.25,
    )
    flipping = simulate_specs(config, specs).summary
    fixed = simulate_specs(replace(config, rebalance=False), specs).summary
    assert flipping["role_flips"] == 2 and flipping["num_colocated"] == 0  # started 1P+1D
    assert fixed["role_flips"] == 0
    assert flipping["request_goodput"] > 1.03 * fixed["request_goodput"], (flipping, fixed)


def test_progress_reports_finished_requests_as_the_run_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import loadgen.sim.cluster as sim_cluster

    monkeypatch.setattr(sim_cluster, "_PROGRESS_EVERY", 10)  # events between calls
    seen: list[tuple[int, int, float]] = []
    config = SimConfig(
        workload=WorkloadConfig(input_len="64", output_len="16", num_requests=30, seed=1),
        rate=RateSpec(20.0),
        num_prefill=1,
        num_decode=1,
        policy=RR,
        profile=PROFILE,
        progress=lambda done, total, at_s: seen.append((done, total, at_s)),
    )
    result = simulate(config)
    assert len(seen) >= 5, seen
    assert {total for _, total, _ in seen} == {30}
    done, times = [d for d, _, _ in seen], [t for _, _, t in seen]
    assert done == sorted(done) and times == sorted(times) and done[-1] > done[0]
    assert done[-1] <= result.summary["completed"] == 30


def test_the_cli_progress_line_waits_its_interval(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loadgen.sim import cli

    clock = iter([0.0, 0.5, 2.5, 3.0, 5.0])  # at creation, then at each call
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    progress = cli.Progress("20", every_s=2.0)
    for done in (1, 2, 3, 4):
        progress(done, 10, done * 1.5)
    assert capsys.readouterr().err.splitlines() == [
        "baton simulate @ 20: 2/10 requests finished, 3.0 simulated s",
        "baton simulate @ 20: 4/10 requests finished, 6.0 simulated s",
    ]
