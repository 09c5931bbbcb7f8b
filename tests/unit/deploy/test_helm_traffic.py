"""The Helm chart's traffic and access: gateway probes, disruption budgets, API
keys, network policies, metrics scraping and the Ray token, for the defaults and
every ci/ value set."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.deploy.chart_objects import (
    by_kind,
    gateway_pod,
    one,
    pods,
)
from tests.unit.deploy.conftest import NAMESPACE, VALUE_SETS, load_values
from tests.unit.deploy.gateway_routes import gateway_routes

SETS = list(VALUE_SETS)


@pytest.mark.parametrize("name", SETS)
def test_gateway_probes_hit_routes_the_gateway_serves(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    gateway = gateway_pod(docs)
    main = gateway.main
    get_paths = {path for method, path in gateway_routes() if method == "GET"}
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = main[probe]["httpGet"]
        assert http["path"] in get_paths, (probe, http["path"])
        assert http["port"] == "http"
    # Readiness must follow /health (503 while starting or draining).
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["spec"]["ports"][0]["port"] == ports["http"]
    selected = [
        p
        for p in pods(docs)
        if service["spec"]["selector"].items() <= p.template["metadata"]["labels"].items()
    ]
    assert selected == [gateway]  # the Service reaches the gateways, and only them
    assert f"--port {ports['http']}" in main["args"][0]
    assert "RAY_ADDRESS=auto exec baton gateway" in main["args"][0]


@pytest.mark.parametrize("name", SETS)
def test_the_gateways_have_a_disruption_budget_keeping_one_serving(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    labels = gateway_pod(docs).template["metadata"]["labels"]
    budgets = [
        b["spec"]
        for b in by_kind(docs, "PodDisruptionBudget")
        if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert budgets == [{"minAvailable": 1, "selector": budgets[0]["selector"]}]
    assert budgets[0]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


@pytest.mark.parametrize("name", SETS)
def test_api_key_comes_from_the_named_secret_only_when_given(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    api_key = load_values(name).get("apiKey", {})
    env = {e["name"]: e for e in gateway_pod(rendered_sets[name]).main["env"]}
    for pod in pods(rendered_sets[name]):  # no other pod holds the key
        if pod.source != "gateway":
            assert "BATON_API_KEY" not in {e["name"] for e in pod.main["env"]}, pod.group
    if api_key.get("existingSecret"):
        ref = env["BATON_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": api_key["existingSecret"], "key": api_key.get("key", "api-key")}
    else:
        assert "BATON_API_KEY" not in env


def test_a_key_file_secret_is_mounted_into_the_gateway_and_passed_as_api_keys_file(
    render_fn: Any,
) -> None:
    docs = render_fn({"apiKeys": {"existingSecret": "baton-keys", "key": "keys.yaml"}})
    head = gateway_pod(docs)
    assert "--api-keys-file /etc/baton-keys/keys.yaml" in head.main["args"][0]
    mount = next(m for m in head.main["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/baton-keys", "readOnly": True}
    volume = next(v for v in head.spec["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "baton-keys"
    plain = gateway_pod(render_fn({}))
    assert "--api-keys-file" not in plain.main["args"][0]
    assert all(v["name"] != "api-keys" for v in plain.spec["volumes"])


def _policies_for(docs: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    return [
        p["spec"]
        for p in by_kind(docs, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]


@pytest.mark.parametrize("name", SETS)
def test_network_policy_lets_only_the_release_reach_workers_and_only_gateways_take_http(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    """Worker and KV-transfer ports: reachable from the release's gateways, workers and head
    (Ray and the controller) only; the gateway port: on the gateways only."""
    docs = rendered_sets[name]
    values = load_values(name)
    extra = values.get("networkPolicy", {}).get("extraIngress", [])
    release = dict(one(docs, "Service")["spec"]["selector"])
    release.pop("app.kubernetes.io/component")
    for pod in pods(docs):
        labels = pod.template["metadata"]["labels"]
        rules = [r for spec in _policies_for(docs, labels) for r in spec["ingress"]]
        assert all(spec["policyTypes"] == ["Ingress"] for spec in _policies_for(docs, labels))
        for rule in rules:
            if rule in extra:
                continue
            peers = rule.get("from", [])
            intra = bool(peers) and all(
                p.get("podSelector", {}).get("matchLabels") == release for p in peers
            )
            if pod.source == "gateway" and not intra:
                assert rule["ports"] == [{"port": "http", "protocol": "TCP"}], rule
            else:
                assert intra, (pod.group, rule)  # a worker, the head: only from the release
        assert rules, pod.group  # every pod is covered by a policy
        if pod.is_worker:
            ports = {p["name"] for p in pod.main.get("ports", [])}
            assert "nixl-side" in ports  # the KV-transfer port the policy guards


@pytest.mark.parametrize("name", SETS)
def test_each_worker_group_has_a_disruption_budget_selecting_its_pods(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    budgets = [b["spec"] for b in by_kind(docs, "PodDisruptionBudget")]
    for pod in pods(docs):
        labels = pod.template["metadata"]["labels"]
        matching = [b for b in budgets if b["selector"]["matchLabels"].items() <= labels.items()]
        if pod.is_worker:
            assert len(matching) == 1 and matching[0]["maxUnavailable"] == 1, pod.group
        elif pod.source == "head" and load_values(name).get("podDisruptionBudget", {}).get(
            "head", {}
        ).get("enabled"):
            assert [b["maxUnavailable"] for b in matching] == [0]


@pytest.mark.parametrize("name", SETS)
def test_service_monitor_scrapes_the_gateway_metrics_route_when_enabled(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    monitors = by_kind(docs, "ServiceMonitor")
    if not load_values(name).get("serviceMonitor", {}).get("enabled"):
        assert monitors == []
        return
    (monitor,) = monitors
    service = one(docs, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert ("GET", endpoint["path"]) in gateway_routes()


@pytest.mark.parametrize("name", SETS)
def test_ray_token_secret_and_no_dashboard_outside_the_pod(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for pod in pods(docs)
        for e in pod.main["env"]
        if e["name"] == "RAY_AUTH_TOKEN"
    }
    assert len(refs) == 1  # head and workers share one token
    (ref,) = refs
    assert len(secrets[ref]["data"]["token"]) >= 48  # created by the chart, base64
    spec = one(docs, "RayCluster")["spec"]["headGroupSpec"]
    assert spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    ports = [p for pod in pods(docs) for c in pod.spec["containers"] for p in c.get("ports", [])]
    assert not any(p["containerPort"] == 8265 for p in ports)
    for service in by_kind(docs, "Service"):
        assert all(p["port"] != 8265 for p in service["spec"]["ports"])


def test_a_given_ray_token_secret_is_used_and_none_is_created(render_fn: Any) -> None:
    docs = render_fn({"rayAuth": {"existingSecret": "my-ray-token", "key": "t"}})
    assert not by_kind(docs, "Secret")
    for pod in pods(docs):
        env = {e["name"]: e for e in pod.main["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "my-ray-token",
            "key": "t",
        }
