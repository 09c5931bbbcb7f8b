"""Reservations keep two back-to-back requests from taking the same last slot."""

from __future__ import annotations

from router.reservations import reserve
from router.types import LengthClass, Plan, Reject, Role
from tests.unit.router.builders import busy, policy, request, view, worker


def test_a_reserved_slot_is_not_given_twice() -> None:
    # d_tight has one seat left (max_num_seqs 4, 3 running); d_roomy is emptier.
    v = view(
        worker("p", Role.PREFILL),
        worker("d_tight", Role.DECODE, busy(3, 3000), max_num_seqs=4),
        worker("d_roomy", Role.DECODE, busy(1, 100)),
    )
    pol = policy()
    first = pol.plan(request(500), v, 0.0)
    assert isinstance(first, Plan) and first.decode_worker == "d_tight"  # the fullest
    v2 = reserve(v, first, request(500))
    second = pol.plan(request(500), v2, 0.0)
    assert isinstance(second, Plan) and second.decode_worker == "d_roomy"
    # Untouched workers keep their objects, so only touched rows are recomputed.
    assert v2.workers[2] is v.workers[2]


def test_reservation_adds_queue_work_and_a_running_request() -> None:
    v = view(
        worker("p", Role.PREFILL, short_tokens=100, short_requests=1), worker("d", Role.DECODE)
    )
    plan = Plan(prefill_worker="p", decode_worker="d", length_class=LengthClass.SHORT)
    v2 = reserve(v, plan, request(40, max_tokens=7))
    p, d = v2.workers
    assert p.queued_tokens[LengthClass.SHORT] == 140 and p.queued_requests[LengthClass.SHORT] == 2
    assert d.running[-1].num_tokens_held == 40 and d.running[-1].max_tokens == 7
    assert d.num_free_blocks == v.workers[1].num_free_blocks - 3


def test_colocated_reservation_lands_on_the_host() -> None:
    v = view(worker("m", Role.MIXED))
    v2 = reserve(v, Plan(prefill_worker="m", decode_worker=None), request(16))
    (m,) = v2.workers
    assert len(m.running) == 1 and sum(m.queued_requests.values()) == 1
    assert not isinstance(policy(colocate_roles=(Role.MIXED,)).plan(request(16), v2, 0.0), Reject)
