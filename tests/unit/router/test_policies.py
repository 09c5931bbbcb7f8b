"""Every registered policy honours the Policy contract; the baselines do what they say."""

from __future__ import annotations

import pytest

from router import Policy, available_policies, make_policy
from router.types import Plan, Reject, Role
from tests.unit.router.builders import busy, request, view, worker

BUILTIN = ["least_loaded", "prefix_aware", "round_robin", "slo_goodput"]


def test_registry_lists_and_builds_the_builtins() -> None:
    assert set(BUILTIN) <= set(available_policies())
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_plans_on_live_workers_of_the_right_roles(name: str) -> None:
    policy = make_policy(name)
    assert isinstance(policy, Policy) and policy.name == name
    v = view(
        worker("p_dead", Role.PREFILL, alive=False),
        worker("p", Role.PREFILL),
        worker("d_drain", Role.DECODE, draining=True),
        worker("d", Role.DECODE),
    )
    for _ in range(3):
        plan = policy.plan(request(200), v, 0.0)
        assert isinstance(plan, Plan)
        assert plan.prefill_worker in {"p", "d"}
        assert plan.decode_worker in {"d", None}


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_rejects_without_live_workers(name: str) -> None:
    policy = make_policy(name)
    for v in (view(), view(worker("p", Role.PREFILL, alive=False))):
        result = policy.plan(request(200), v, 0.0)
        assert isinstance(result, Reject) and not result.hold
        assert result.retry_after_s > 0


@pytest.mark.parametrize("name", BUILTIN)
def test_contract_colocates_when_roles_are_not_split(name: str) -> None:
    result = make_policy(name).plan(request(200), view(worker("m", Role.MIXED)), 0.0)
    assert isinstance(result, Plan) and result.colocated and result.prefill_worker == "m"


def test_round_robin_cycles() -> None:
    v = view(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL), worker("d", Role.DECODE))
    policy = make_policy("round_robin")
    picks = [policy.plan(request(), v, 0.0) for _ in range(3)]
    assert [p.prefill_worker for p in picks if isinstance(p, Plan)] == ["p0", "p1", "p0"]


def test_least_loaded_picks_the_shortest_queue_and_emptiest_decoder() -> None:
    v = view(
        worker("p_busy", Role.PREFILL, short_tokens=500),
        worker("p_calm", Role.PREFILL, short_tokens=20),
        worker("d_busy", Role.DECODE, busy(8, 1000)),
        worker("d_calm", Role.DECODE, busy(1, 1000)),
    )
    plan = make_policy("least_loaded").plan(request(), v, 0.0)
    assert isinstance(plan, Plan)
    assert (plan.prefill_worker, plan.decode_worker) == ("p_calm", "d_calm")


PREFIX = (11, 12, 13, 14)


def _prefix_view(holder_queue: int, digest_a=frozenset(), digest_b=frozenset()):
    return view(
        worker("pa", Role.PREFILL, short_tokens=holder_queue, digest=digest_a),
        worker("pb", Role.PREFILL, digest=digest_b),
        worker("d", Role.DECODE),
    )


def test_prefix_aware_follows_the_cached_prefix() -> None:
    policy = make_policy("prefix_aware")
    # Nothing cached yet: the least-loaded worker takes it.
    first = policy.plan(request(prefix_hashes=PREFIX), _prefix_view(100), 0.0)
    assert isinstance(first, Plan) and first.prefill_worker == "pb"
    # pa now holds the prefix: the repeat goes there although pb is idle.
    again = policy.plan(request(prefix_hashes=PREFIX), _prefix_view(100, frozenset(PREFIX)), 0.0)
    assert isinstance(again, Plan) and again.prefill_worker == "pa"
    # The longer match wins: pb holds all four blocks, pa the first two.
    partial = _prefix_view(100, frozenset(PREFIX[:2]), frozenset(PREFIX))
    longer = policy.plan(request(prefix_hashes=PREFIX), partial, 0.0)
    assert isinstance(longer, Plan) and longer.prefill_worker == "pb"


def test_prefix_aware_load_guard_diverts_from_an_overloaded_holder() -> None:
    policy = make_policy("prefix_aware", guard_factor=2.0, guard_slack_tokens=4096)
    overloaded = _prefix_view(50_000, frozenset(PREFIX))  # > 2·0 + 4096 queued tokens
    plan = policy.plan(request(prefix_hashes=PREFIX), overloaded, 0.0)
    assert isinstance(plan, Plan) and plan.prefill_worker == "pb"


@pytest.mark.parametrize("name", BUILTIN)
def test_settings_are_passed_only_where_taken(name: str) -> None:
    from router import make_policy_from_settings

    settings = {"max_hold_s": 1.5, "length_split": "spatial", "memory_fraction": 0.9}
    policy = make_policy_from_settings(name, settings)
    assert policy.name == name
    if name == "slo_goodput":
        assert (policy.max_hold_s, policy.length_split) == (1.5, "spatial")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy_from_settings("nope", settings)
