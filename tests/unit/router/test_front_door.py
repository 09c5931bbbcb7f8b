"""router.Router: incremental view, reservations, θ observed once per request, hold/reject."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import pytest
from pydantic import ValidationError

from router.admission import AdmissionSettings
from router.correction import CorrectionSettings
from router.front_door import Hold, Router, RouterSettings
from router.types import SLO, LengthClass, Plan, Reject, RequestProfile, Role, RunningRequest
from services.config import ClusterConfig, RouterConfig
from services.workers.messages import WorkerSnapshot
from tests.unit.router.builders import PROFILE, SLO_DEFAULT


def snapshot(
    worker_id: str,
    role: Role,
    seq: int = 1,
    *,
    free_blocks: int = 1000,
    waiting: tuple[int, ...] = (),
    running: tuple[RunningRequest, ...] = (),
    prefix_digest: tuple[int, ...] = (),
) -> WorkerSnapshot:
    return WorkerSnapshot(
        worker_id=worker_id,
        role=role,
        draining=False,
        seq=seq,
        time_s=float(seq),
        block_size=16,
        num_total_blocks=1000,
        num_free_blocks=free_blocks,
        num_cached_blocks=0,
        num_held_blocks=0,
        running=running,
        waiting_prompt_lens=waiting,
        recent_steps=(),
        recent_output_lens=(),
        num_preemptions=0,
        num_pending_pulls=0,
        num_finished_requests=0,
        kv_bytes_per_token=100_000,
        max_num_seqs=64,
        max_model_len=4096,
        prefix_digest=prefix_digest,
    )


def request(request_id: str, prompt: int = 500, arrival_s: float = 0.0) -> RequestProfile:
    return RequestProfile(request_id, prompt, prompt, max_tokens=100, arrival_s=arrival_s)


def router(**options: Any) -> Router:
    settings = RouterSettings(
        profile=PROFILE, default_slo=SLO_DEFAULT, length_split="temporal", colocate_roles=()
    )
    r = Router(replace(settings, **options))
    r.update(snapshot("p", Role.PREFILL))
    r.update(snapshot("d", Role.DECODE))
    return r


def test_settings_from_the_config_file_section_are_in_seconds() -> None:
    s = RouterSettings.from_config(RouterConfig(max_hold_s=2.5, length_threshold_tokens=300))
    assert s.policy == "slo_goodput" and s.length_split == "spatial"
    assert s.max_hold_s == 2.5 and s.length_threshold_tokens == 300
    assert s.default_slo.ttft_s == pytest.approx(RouterConfig().default_slo.ttft_ms / 1e3)


def test_update_rebuilds_only_the_worker_that_reported() -> None:
    r = router()
    before = r.view()
    assert r.view() is before  # nothing changed: the same view object
    r.update(snapshot("p", Role.PREFILL, seq=2, waiting=(40,)))
    after = r.view()
    assert after.workers[1] is before.workers[1]  # "d" untouched
    assert after.workers[0] is not before.workers[0]
    assert after.workers[0].queued_requests[LengthClass.SHORT] == 1
    r.update(snapshot("p", Role.PREFILL, seq=1, waiting=(40, 40)))  # out of order: ignored
    assert r.view() is after


def test_queued_prompts_are_classified_by_the_routers_threshold() -> None:
    r = router(length_threshold_tokens=100)  # not the gateway's old fixed 512
    r.update(snapshot("p", Role.PREFILL, seq=2, waiting=(50, 150, 300)))
    p = r.view().workers[0]
    assert p.queued_tokens == {LengthClass.SHORT: 50, LengthClass.LONG: 450}
    assert p.queued_requests == {LengthClass.SHORT: 1, LengthClass.LONG: 2}
    assert r.policy.length_threshold == 100  # type: ignore[attr-defined]


def test_theta_moves_only_with_new_requests_not_while_one_is_held() -> None:
    # A 10 s TTFT target: the held request stays reachable for the whole 5 s hold.
    r = router(default_slo=SLO(ttft_s=10.0, tpot_s=0.02))
    r.update(snapshot("d", Role.DECODE, seq=2, free_blocks=0))  # no decode room: hold
    theta = r.classifier.threshold_tokens  # the knee of PROFILE's prefill curve: 100
    up = math.exp(0.05 * (1 - 0.2))  # one observation above θ (step 0.05, quantile 0.8)
    held = request("held", prompt=600)
    now = 0.0
    while now < 4.99:  # re-placed every 10 ms for 5 s, as the gateway does
        assert isinstance(r.place(held, now), Hold)
        now += 0.01
    assert r.classifier.threshold_tokens == pytest.approx(theta * up)
    assert isinstance(r.place(held, 5.0), Reject)  # max_hold_s reached
    assert r.classifier.threshold_tokens == pytest.approx(theta * up)
    r.place(request("new", prompt=600), 5.0)
    assert r.classifier.threshold_tokens == pytest.approx(theta * up * up)


def test_theta_sees_a_prompt_as_what_it_prefills_where_its_prefix_is_cached() -> None:
    # 500 tokens, 31 full blocks of 16; "p" holds the first 30: 20 tokens to prefill there.
    blocks = tuple(range(1000, 1031))
    cached = router()
    cached.update(snapshot("p", Role.PREFILL, seq=2, prefix_digest=blocks[:30]))
    cold = router()
    theta = cold.classifier.threshold_tokens  # 100, the knee of PROFILE's prefill curve
    for r in (cached, cold):
        assert isinstance(r.place(replace(request("a"), prefix_hashes=blocks), 0.0), Plan)
    assert cached.classifier.threshold_tokens < theta < cold.classifier.threshold_tokens
    # The length classes' shares (the spatial LONG pool's size) count it as short.
    assert cached.classifier.long_request_share < cold.classifier.long_request_share
    assert cached.classifier.long_share < cold.classifier.long_share


def test_a_plan_is_reserved_until_released() -> None:
    r = router()
    plan = r.place(request("a", prompt=500), 0.0)
    assert isinstance(plan, Plan) and (plan.prefill_worker, plan.decode_worker) == ("p", "d")
    p, d = r.view().workers
    assert sum(p.queued_tokens.values()) == 500 and sum(p.queued_requests.values()) == 1
    assert d.running == (RunningRequest(500, 0, 100),)
    assert d.num_free_blocks == 1000 - 32  # ceil(501 / 16)
    r.release("a")
    p, d = r.view().workers
    assert sum(p.queued_tokens.values()) == 0 and d.running == () and r.num_reservations() == 0


def test_a_dead_worker_leaves_the_view_with_its_reservations() -> None:
    r = router()
    assert isinstance(r.place(request("a"), 0.0), Plan)
    r.mark_dead("d")
    r.update(snapshot("d", Role.DECODE, seq=9))  # late telemetry of a dead worker
    assert [w.worker_id for w in r.view().workers] == ["p"]
    assert r.num_reservations() == 0


def test_a_failover_is_never_refused_for_its_age() -> None:
    r = router()
    old = request("f", arrival_s=0.0)
    assert isinstance(r.place(old, 100.0), Reject)  # 100 s old: its TTFT is lost
    assert isinstance(r.place(old, 100.0, replaced=True), Plan)


def test_a_reserved_slot_is_not_given_twice() -> None:
    # d_tight has one seat left (max_num_seqs 4, 3 running) and the least KV; d_roomy
    # has seats but holds more.
    r = router()
    r.mark_dead("d")
    r.update(replace(snapshot("d_tight", Role.DECODE, running=_busy(3, 10)), max_num_seqs=4))
    r.update(snapshot("d_roomy", Role.DECODE, running=_busy(1, 3000)))
    first = r.place(request("a"), 0.0)
    assert isinstance(first, Plan) and first.decode_worker == "d_tight"  # the emptiest
    roomy = r.view().workers[2]
    second = r.place(request("b"), 0.0)
    assert isinstance(second, Plan) and second.decode_worker == "d_roomy"
    assert r.view().workers[2] is not roomy  # now reserved on
    r.release("a")
    third = r.place(request("c"), 0.0)
    assert isinstance(third, Plan) and third.decode_worker == "d_tight"


def test_a_decode_link_with_a_tpot_of_kv_queued_on_it_gives_way_to_a_free_one() -> None:
    # PROFILE's link: 150 prompt tokens of KV take 15 ms, the TPOT target is 20 ms. The
    # emptier decode worker is preferred until the KV reserved to land on it would hold a
    # request's second token past one TPOT.
    r = router()
    r.mark_dead("d")
    r.update(snapshot("d_busy", Role.DECODE, running=_busy(3, 300)))
    r.update(snapshot("d_free", Role.DECODE))

    def decode_of(request_id: str) -> str | None:
        plan = r.place(request(request_id, prompt=150), 0.0)
        assert isinstance(plan, Plan)
        return plan.decode_worker

    assert [decode_of("a"), decode_of("b")] == ["d_free", "d_free"]  # 0, then 15 ms queued
    assert decode_of("c") == "d_busy"  # 30 ms queued on d_free's link
    assert [w.inbound_tokens for w in r.view().workers[1:]] == [150, 300]
    r.release("a", "d_free")  # landed and running there: off the link
    assert decode_of("e") == "d_free"


def _placed_on_one_mixed_host() -> Router:
    """A router over one mixed worker ``m`` with request ``a`` (16 tokens) placed there."""
    r = Router(
        RouterSettings(profile=PROFILE, default_slo=SLO_DEFAULT, colocate_roles=(Role.MIXED,))
    )
    r.update(snapshot("m", Role.MIXED))
    plan = r.place(request("a", prompt=16), 0.0)
    assert isinstance(plan, Plan) and plan.colocated
    return r


def test_a_colocated_reservation_lands_once_on_its_host() -> None:
    r = _placed_on_one_mixed_host()
    (m,) = r.view().workers
    assert len(m.running) == 1 and sum(m.queued_requests.values()) == 1
    assert m.num_free_blocks == 1000 - 2  # ceil(17 / 16), taken once


def _busy(count: int, held: int) -> tuple[RunningRequest, ...]:
    return tuple(RunningRequest(held, 0, 1000) for _ in range(count))


def test_each_worker_drops_its_part_of_a_reservation_when_it_counts_the_request() -> None:
    r = router()
    plan = r.place(request("a", prompt=500), 0.0)
    assert isinstance(plan, Plan) and not plan.colocated
    r.release("a", "p")  # the prefill worker's first event: off its queue
    p, d = r.view().workers
    assert sum(p.queued_tokens.values()) == 0
    assert d.running == (RunningRequest(500, 0, 100),)  # still on its way to "d"
    assert d.inbound_tokens == 500 and d.num_free_blocks == 1000 - 32
    r.release("a", "d")  # d's first event: landed, but d's last report predates it
    d = r.view().workers[1]
    assert d.running == (RunningRequest(500, 0, 100),) and d.num_free_blocks == 1000 - 32
    assert d.inbound_tokens == 0 and r.num_reservations() == 1
    r.release("a", "d")  # the stream's end on d says the same again: nothing changes
    assert r.view().workers[1] is d
    r.update(snapshot("d", Role.DECODE, seq=2, running=(RunningRequest(501, 1, 100),)))
    d = r.view().workers[1]  # the report counts it: the reservation is gone
    assert d.running == (RunningRequest(501, 1, 100),) and d.num_free_blocks == 1000
    assert r.num_reservations() == 0


def test_a_prompt_its_worker_reports_waiting_is_counted_once() -> None:
    """From the prefill worker's admission of a prompt to its first token, the worker's
    reports show it waiting: the reservation's count of it goes then (it counted twice,
    which made every queue behind it look up to twice as long)."""
    r = router()
    r.place(request("a", prompt=500), 0.0)

    def queued_on_p() -> int:
        return sum(r.view().workers[0].queued_tokens.values())

    assert queued_on_p() == 500
    admitted = snapshot("p", Role.PREFILL, seq=2, waiting=(500,))
    r.update(replace(admitted, waiting_request_ids=("a",)))
    assert queued_on_p() == 500  # the report's count only
    # A report that does not name its waiting prompts leaves the reservations' counts.
    r.place(request("b", prompt=300), 0.0)
    r.update(snapshot("p", Role.PREFILL, seq=3, waiting=(500, 300)))
    assert queued_on_p() == 500 + 300 + 300
    r.release("a", "p")  # a's first token
    r.update(
        replace(snapshot("p", Role.PREFILL, seq=4, waiting=(300,)), waiting_request_ids=("b",))
    )
    assert queued_on_p() == 300
    assert r.pending_age_s("p", 2.0) == 2.0  # b still waits for its first token


def test_an_abandoned_plan_is_unreserved_at_once_where_it_would_have_run() -> None:
    r = router()
    plan = r.place(request("a", prompt=500), 0.0)
    assert isinstance(plan, Plan) and plan.decode_worker == "d"
    r.unreserve("a", "d")  # it will not run there: no report is waited for
    assert r.view().workers[1].running == () and r.num_reservations() == 1
    r.unreserve("a", "p")
    assert r.num_reservations() == 0


def test_a_request_started_on_its_colocated_host_leaves_the_queue_and_stays_running() -> None:
    r = _placed_on_one_mixed_host()
    r.release("a", "m")  # prefilled: its first token
    (m,) = r.view().workers
    assert sum(m.queued_requests.values()) == 0 and len(m.running) == 1
    assert r.pending_age_s("m", 5.0) == 0.0  # nothing waits for its first event there
    r.update(snapshot("m", Role.MIXED, seq=1))  # an old report, out of order: ignored
    r.update(snapshot("m", Role.MIXED, seq=2, free_blocks=998))
    (m,) = r.view().workers
    assert m.running == () and r.num_reservations() == 0


def test_a_request_started_before_its_workers_first_report_is_dropped_there() -> None:
    r = router()
    r.place(request("a", prompt=500), 0.0)
    r.mark_dead("d")  # gone with its reservations: nothing left to count
    assert r.num_reservations() == 0
    plan = r.place(request("b", prompt=500), 0.0)
    assert isinstance(plan, Reject)  # no decode worker left


def test_links_are_priced_from_measured_transfers_and_mixed_workers_by_their_budget() -> None:
    r = router()
    p, d = r.view().workers
    seed = PROFILE.transfer
    assert p.link_bandwidth_bytes_per_s == 0.0 and p.link_latency_s is None  # the profile's
    for num_bytes in (1e6, 4e6, 2e6, 8e6):  # 2 ms + bytes / 1 GB/s
        r.observe_transfer("p", "d", int(num_bytes), 0.002 + num_bytes / 1e9)
    p, d = r.view().workers
    for w in (p, d):
        assert w.link_bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.05)  # shown
        assert w.link_latency_s == pytest.approx(0.002, rel=0.05)  # once moved 5 %
    assert r.link("d").latency_s != seed.latency_s
    mixed = replace(snapshot("m", Role.MIXED), prefill_budget_tokens=512, long_prefill_tokens=128)
    r.update(mixed)
    assert r.view().workers[2].prefill_budget_tokens == 512
    assert r.view().workers[2].long_prefill_tokens == 128  # the queue is priced as it runs


def test_a_released_reservation_brings_back_the_workers_peak_table_undrawn() -> None:
    """The decode worker's past-future table is drawn once per running set: placing a
    request draws one with the request added, and releasing it shows the report's own
    running set again, whose table (and draws) come back instead of being redrawn."""
    running = tuple(RunningRequest(200 + 10 * i, 5 * i, 300) for i in range(8))
    r = router()
    r.update(snapshot("d", Role.DECODE, seq=2, running=running))
    r.observe_outcome(100)
    policy: Any = r.policy
    policy.refresh(r.view())
    table = policy._table.tables[1]
    plan = r.place(request("a"), 0.0)
    assert isinstance(plan, Plan) and plan.decode_worker == "d"
    policy.refresh(r.view())
    reserved = policy._table.tables[1]
    assert reserved is not table and reserved.num_running == len(running) + 1
    r.release("a")
    policy.refresh(r.view())
    assert policy._table.tables[1] is table


def test_admission_keys_of_the_router_section_reach_the_router() -> None:
    config = RouterConfig.model_validate(
        {
            "admission": {
                "enabled": False,
                "headroom": 0.9,
                "batch_headroom": 0.5,
                "min_retry_after_s": 2.0,
                "adaptive": False,
                "correction": {
                    "window": 8,
                    "min_samples": 2,
                    "min_scale": 0.5,
                    "max_scale": 3,
                    "max_age_s": 9,
                },
            }
        }
    )
    settings = RouterSettings.from_config(config, PROFILE)
    assert settings.admission == AdmissionSettings(False, 0.9, 0.5, 2.0, adaptive=False)
    assert settings.correction == CorrectionSettings(8, 2, 0.5, 3.0, max_age_s=9.0)
    r = Router(settings)
    assert r.corrector.settings is settings.correction
    assert r.admission.settings is settings.admission
    assert r.policy.slo_headroom == 0.9  # type: ignore[attr-defined]
    assert r.policy.batch_slo_headroom == 0.5  # type: ignore[attr-defined]
    assert r.policy.min_retry_after_s == 2.0  # type: ignore[attr-defined]
    default = RouterSettings.from_config(RouterConfig(), PROFILE)
    assert (default.admission, default.correction) == (AdmissionSettings(), CorrectionSettings())


@pytest.mark.parametrize(
    ("admission", "message"),
    [
        ({"batch_headroom": 1.5}, "admission.batch_headroom"),
        ({"batch_headroom": 0}, "admission.batch_headroom"),
        ({"min_retry_after_s": 0}, "admission.min_retry_after_s"),
        ({"correction": {"window": 1}}, "admission.correction.window"),
        ({"correction": {"max_scale": 0.5}}, "admission.correction.max_scale"),
        ({"correction": {"max_age_s": 0}}, "admission.correction.max_age_s"),
        ({"correction": {"window": 4, "min_samples": 5}}, "must not exceed window"),
        ({"headroom": 1.5}, "admission.headroom"),
        ({"head_room": 0.5}, "admission.head_room"),  # unknown key
    ],
)
def test_admission_keys_out_of_bounds_are_refused_naming_them(
    admission: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        ClusterConfig.model_validate({"router": {"admission": admission}})


def test_a_fan_out_of_short_prompts_fits_one_idle_colocated_worker() -> None:
    # baton serve's defaults (the shipped profile, TTFT 2 s / TPOT 200 ms, slo_goodput with
    # admission) and one colocated tiny worker, 4 prompts x n=16 of 3 tokens. The chunked
    # step was priced with a full 2047-token chunk (0.227 s > 200 ms) and every sequence
    # was refused; served, the 64 took TTFT <= 1.65 s and TPOT p50 58-145 ms (CPU).
    r = Router(RouterSettings.from_config(RouterConfig()))
    r.update(replace(snapshot("m", Role.MIXED), max_num_seqs=64, prefill_budget_tokens=2048))
    plans = [r.place(request(f"s{i}", prompt=3), 0.0) for i in range(64)]
    assert all(isinstance(p, Plan) and p.prefill_worker == "m" for p in plans)
