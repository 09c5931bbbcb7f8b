"""Per-request ``slo`` and ``priority``: validated at the edge, carried to the router,
and acted on by ``slo_goodput`` (early 429s, batch shed first) with metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from router.policies.round_robin import RoundRobin
from router.policy import register_policy
from router.types import SLO, ClusterView, Plan, Priority, Reject, RequestProfile, Role
from services.gateway.service import GatewayService
from tests.unit.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}


@register_policy("test_recording")
@dataclass
class _Recording:
    """Round robin that remembers every profile it was asked to place."""

    name: str = "test_recording"
    seen: list[RequestProfile] = field(default_factory=list)
    _inner: RoundRobin = field(default_factory=RoundRobin)

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        self.seen.append(profile)
        return self._inner.plan(profile, view, now_s)


def _recorded(svc: GatewayService) -> list[RequestProfile]:
    policy = svc.router.policy
    assert isinstance(policy, _Recording)
    return policy.seen


def _counter(svc: GatewayService, reason: str, priority: str) -> float:
    value: float = svc.metrics.rejections.labels(reason, priority)._value.get()
    return value


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_targets_and_priority_reach_the_router_with_config_defaults(
    gateway: Any, path: str, body: dict[str, Any]
) -> None:
    svc, client = await gateway(
        **{
            "router.policy": "test_recording",
            "router.default_slo.ttft_ms": 1500.0,
            "router.default_slo.tpot_ms": 123.0,
        }
    )
    asked = await client.post(path, json={**body, "slo": {"ttft_ms": 250}, "priority": "batch"})
    plain = await client.post(path, json=body)
    assert asked.status_code == plain.status_code == 200, (asked.text, plain.text)
    first, second = _recorded(svc)
    assert first.slo == SLO(ttft_s=0.25, tpot_s=0.123)  # the missing target from config
    assert first.priority is Priority.BATCH
    assert second.slo == SLO(ttft_s=1.5, tpot_s=0.123)
    assert second.priority is Priority.INTERACTIVE


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"slo": {"ttft_ms": -5}}, "slo.ttft_ms"),
        ({"slo": {"tpot_ms": 0}}, "slo.tpot_ms"),
        ({"slo": {"ttft_ms": "soon"}}, "slo.ttft_ms"),
        ({"slo": "fast"}, "slo"),
        ({"priority": "urgent"}, "priority"),
    ],
)
@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_bad_targets_are_400_naming_the_field(
    gateway: Any, path: str, body: dict[str, Any], patch: dict[str, Any], param: str
) -> None:
    _, client = await gateway()
    r = await client.post(path, json={**body, **patch})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError"


async def test_openapi_documents_slo_and_priority(gateway: Any) -> None:
    _, client = await gateway()
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        assert "slo" in props and "priority" in props, name
        assert "batch" in json.dumps(props["priority"])
    assert {"ttft_ms", "tpot_ms"} <= set(schemas["LatencyTargets"]["properties"])


async def test_impossible_ttft_is_429_not_worth_retrying_and_counted(gateway: Any) -> None:
    svc, client = await gateway(**{"router.policy": "slo_goodput"})
    r = await client.post("/v1/chat/completions", json={**CHAT, "slo": {"ttft_ms": 0.001}})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "RateLimitError"
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-should-retry"] == "false"  # no queue anywhere would make it
    assert _counter(svc, "ttft target unreachable", "interactive") == 1
    metrics = (await client.get("/metrics")).text
    assert (
        'baton_router_rejections_total{priority="interactive",reason="ttft target unreachable"} 1.0'
        in metrics
    )
    assert 'baton_router_decision_seconds_count{policy="slo_goodput"}' in metrics
    ok = await client.post("/v1/chat/completions", json={**CHAT, "slo": {"ttft_ms": 5000}})
    assert ok.status_code == 200, ok.text  # the same request with a reachable target


async def test_batch_is_shed_while_interactive_is_served_under_the_same_load(
    gateway: Any,
) -> None:
    """Load the decode worker's memory to ~85 %: above batch's 80 % limit, under
    interactive's 95 %. FakeEngine pools hold 256 blocks of 16 tokens. Latency targets
    out of reach of any prediction: FakeEngine's 0.1 ms steps make the router's error
    margin huge once it has seen them, and this test is about memory."""
    svc, client = await gateway(**{"router.policy": "slo_goodput"})
    roles = {s.role: w for w, s in svc.router.reports().items()}
    load = RequestProfile("load", 3500, 3500, max_tokens=1)  # held, nothing left to generate
    svc.router.reserve(load, Plan(roles[Role.PREFILL], roles[Role.DECODE]))
    svc.router.release(load.request_id, roles[Role.PREFILL])  # only the decode side is held
    interactive = {**CHAT, "slo": {"ttft_ms": 600_000, "tpot_ms": 600_000}}
    batch = {**interactive, "priority": "batch"}

    shed = await client.post("/v1/chat/completions", json=batch)
    assert shed.status_code == 429, shed.text
    assert "x-should-retry" not in shed.headers  # it would fit once the load is gone
    reasons = {
        sample.labels["reason"]
        for metric in svc.metrics.rejections.collect()
        for sample in metric.samples
        if sample.labels.get("priority") == "batch" and sample.value > 0
    }
    assert reasons == {"no decode capacity within memory and tpot"}

    served = await client.post("/v1/chat/completions", json=interactive)
    assert served.status_code == 200, served.text
    assert _counter(svc, "no decode capacity within memory and tpot", "interactive") == 0

    svc.router.release(load.request_id)
    again = await client.post("/v1/chat/completions", json=batch)
    assert again.status_code == 200, again.text
