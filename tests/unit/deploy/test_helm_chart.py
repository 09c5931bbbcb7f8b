"""The Helm chart: strict lint, strict schema validation of every object, and the
worker groups, Ray resources, autoscaling and cluster config it renders, for the
defaults and every ci/ value set."""

from __future__ import annotations

import re
from typing import Any

import helm_python
import pytest
import yaml

from services.config import ClusterConfig
from tests.unit.deploy.chart_objects import (
    Pod,
    by_kind,
    gateway_pod,
    group_values,
    one,
    pods,
    ray_resources,
)
from tests.unit.deploy.conftest import CHART, NAMESPACE, VALUE_SETS, load_values
from tests.unit.deploy.k8s_schemas import CRDSchemas, SchemaMissingError, validate_object

SETS = list(VALUE_SETS)
ROLES = {"prefill", "decode", "encode", "mixed"}


@pytest.mark.parametrize("name", SETS)
def test_lint_strict_reports_no_errors_or_warnings(name: str) -> None:
    report = helm_python.lint(str(CHART), load_values(name), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    # severity 1 is INFO (e.g. "icon is recommended"); 2 WARNING and 3 ERROR fail strict lint.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", SETS)
def test_every_object_is_valid_against_its_schema(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]], crd_schemas: CRDSchemas
) -> None:
    docs = rendered_sets[name]
    errors = {f"{d['kind']}/{d['metadata']['name']}": validate_object(d, crd_schemas) for d in docs}
    assert {k: v for k, v in errors.items() if v} == {}
    # The pod templates inside the RayCluster are also checked as core PodTemplates, so a
    # misspelt probe or volume field fails here even where a CRD schema is loose.
    for pod in pods(docs):
        wrapper = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": pod.group},
            "template": pod.template,
        }
        assert validate_object(wrapper, crd_schemas) == [], pod.group


def test_an_object_of_an_unknown_kind_fails_instead_of_passing(crd_schemas: CRDSchemas) -> None:
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    with pytest.raises(SchemaMissingError, match="Widget"):
        validate_object(widget, crd_schemas)
    # A RayService has no CRD in shared/crds either.
    with pytest.raises(SchemaMissingError):
        validate_object({**widget, "apiVersion": "ray.io/v1", "kind": "RayService"}, crd_schemas)


def test_crd_validation_is_strict_about_unknown_fields(
    rendered_sets: dict[str, list[dict[str, Any]]], crd_schemas: CRDSchemas
) -> None:
    cluster = yaml.safe_load(yaml.safe_dump(one(rendered_sets["defaults"], "RayCluster")))
    assert validate_object(cluster, crd_schemas) == []
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 3  # typo of "replicas"
    cluster["spec"]["workerGroupSpecs"][0]["minReplicas"] = "one"
    errors = validate_object(cluster, crd_schemas)
    assert any("replica" in e and "unexpected" in e for e in errors), errors
    assert any("minReplicas" in e for e in errors), errors


def _pod_ray_resources(pod: Pod, docs: list[dict[str, Any]]) -> dict[str, float]:
    if pod.source == "raycluster":
        group = next(
            g
            for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
            if g["groupName"] == pod.group
        )
        return ray_resources(group["rayStartParams"]["resources"])
    match = re.search(r"--resources=('[^']*')", pod.main["args"][0])
    assert match, pod.main["args"]
    return ray_resources(match.group(1))


@pytest.mark.parametrize("name", SETS)
def test_each_worker_group_offers_its_roles_ray_resource(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    values = load_values(name)
    per_pod_default = values.get("workerDefaults", {}).get("workersPerPod", 1)
    workers = [p for p in pods(docs) if p.is_worker]
    assert {"prefill", "decode"} <= {p.role for p in workers}
    for pod in workers:
        assert pod.role in ROLES
        expected = group_values(values, pod.group).get("workersPerPod", per_pod_default)
        assert _pod_ray_resources(pod, docs) == {pod.role: expected}


def test_the_large_layout_has_several_groups_per_role(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    groups = {
        p.group: p.role for p in pods(rendered_sets["large-multigroup-values"]) if p.is_worker
    }
    assert groups == {
        "prefill": "prefill",
        "decode": "decode",
        "prefill-long": "prefill",
        "decode-b200": "decode",
        "mixed-small": "mixed",
    }


def _autoscaling(values: dict[str, Any]) -> str:
    auto = values.get("autoscaling", {})
    return auto.get("mode", "ray") if auto.get("enabled") else "none"


@pytest.mark.parametrize("name", SETS)
def test_replicas_are_left_to_the_autoscaler_when_one_is_enabled(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    spec = one(docs, "RayCluster")["spec"]
    groups = spec.get("workerGroupSpecs", [])
    deployments = [d for d in by_kind(docs, "Deployment") if d is not _gateway_deployment(docs)]
    scaled = by_kind(docs, "ScaledObject")
    match _autoscaling(load_values(name)):
        case "none":
            assert "enableInTreeAutoscaling" not in spec and deployments == scaled == []
            for g in groups:
                assert g["replicas"] == g["minReplicas"] == g["maxReplicas"]
        case "ray":
            assert spec["enableInTreeAutoscaling"] is True and deployments == scaled == []
            assert spec["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False
            assert groups
            for g in groups:
                assert "replicas" not in g
                assert 0 <= g["minReplicas"] <= g["maxReplicas"]
        case "keda":
            assert "enableInTreeAutoscaling" not in spec and groups == []
            assert deployments
            targets = {s["spec"]["scaleTargetRef"]["name"]: s["spec"] for s in scaled}
            for d in deployments:
                assert "replicas" not in d["spec"]
                target = targets[d["metadata"]["name"]]
                assert target["scaleTargetRef"]["kind"] == "Deployment"
                assert target["minReplicaCount"] <= target["maxReplicaCount"]


def _gateway_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (gateway,) = [
        d
        for d in by_kind(docs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
    ]
    return gateway


@pytest.mark.parametrize("name", SETS)
def test_only_the_ray_autoscaler_gets_api_access(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    ray_mode = _autoscaling(load_values(name)) == "ray"
    tokens = {p.group: p.spec["automountServiceAccountToken"] for p in pods(docs)}
    assert tokens == {group: ray_mode and group == "head" for group in tokens}
    bindings = by_kind(docs, "RoleBinding")
    if not ray_mode:
        assert bindings == [] and by_kind(docs, "Role") == []
        return
    (binding,) = bindings
    (role,) = by_kind(docs, "Role")
    head_sa = next(pods(docs)).spec["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": head_sa, "namespace": NAMESPACE}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert {("", "pods", "list"), ("ray.io", "rayclusters", "patch")} <= granted


def test_every_autoscaling_mode_is_covered_by_a_value_set() -> None:
    assert {_autoscaling(load_values(n)) for n in SETS} == {"none", "ray", "keda"}


@pytest.mark.parametrize("name", SETS)
def test_the_configmap_is_a_valid_cluster_config_matching_the_groups(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    values = load_values(name)
    config_map = one(docs, "ConfigMap")
    config = ClusterConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    spec = one(docs, "RayCluster")["spec"]
    expected = dict.fromkeys(ROLES, 0)
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s["spec"] for s in by_kind(docs, "ScaledObject")}
    for pod in pods(docs):
        if not pod.is_worker:
            continue
        if pod.source == "deployment":
            num_pods = scaled[
                f"{config_map['metadata']['name'].removesuffix('-config')}-{pod.group}"
            ]["minReplicaCount"]
        else:
            group = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == pod.group)
            num_pods = group.get("replicas", group["minReplicas"])
        expected[pod.role] += num_pods * next(iter(_pod_ray_resources(pod, docs).values()))
    workers = config.workers
    assert (workers.prefill, workers.decode, workers.encode, workers.mixed) == (
        expected["prefill"],
        expected["decode"],
        expected["encode"],
        expected["mixed"],
    )
    assert config.gateway.host == "0.0.0.0"
    assert config.gateway.port == values.get("service", {}).get("port", 8000)
    model = values.get("model", {})
    if model.get("source", "none") != "none":
        assert config.model.name == f"{model.get('mountPath', '/models')}/{model['path']}"
        mounts = {m["name"]: m["mountPath"] for m in next(pods(docs)).main["volumeMounts"]}
        assert mounts["model"] == model.get("mountPath", "/models")


@pytest.mark.parametrize("name", SETS)
def test_the_gateway_is_its_own_deployment_of_two_and_the_head_runs_only_ray_and_the_controller(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered_sets[name]
    values = load_values(name)
    deployment = _gateway_deployment(docs)
    assert deployment["spec"]["replicas"] == values.get("gateway", {}).get("replicas", 2)
    args = gateway_pod(docs).main["args"][0]
    # A Ray node with nothing to schedule on it, joined to the head, then the gateway.
    assert "ray start" in args and "--num-cpus=0 --num-gpus=0" in args
    assert "--address=rel-baton-head-svc.llm.svc:6379" in args
    head = next(pods(docs))
    head_args = head.main["args"][0]
    assert "baton cluster up --config /etc/baton/config.yaml" in head_args
    assert "baton serve" not in head_args and "baton gateway" not in head_args
    assert [p["name"] for p in head.main["ports"]] == ["gcs"]  # no HTTP on the head
    head_params = one(docs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    assert ray_resources(head_params["resources"]) == {"baton_controller": 1}  # the controller's
    for pod in pods(docs):
        if pod.is_worker:
            assert "baton_controller" not in str(pod.template)


def _rendered_config(docs: list[dict[str, Any]]) -> ClusterConfig:
    config_map = one(docs, "ConfigMap")
    return ClusterConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))


@pytest.mark.parametrize("name", SETS)
def test_every_value_set_names_an_existing_backend(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    from services.backends import BACKENDS

    assert _rendered_config(rendered_sets[name]).engine.backend in BACKENDS


@pytest.mark.parametrize(("gpus", "tensor_parallel"), [(1, None), (2, 2)])
def test_gpu_groups_give_each_worker_actor_its_gpus(
    gpus: int, tensor_parallel: int | None, render_fn: Any
) -> None:
    """The chart's worker groups, through the rule `baton serve` launches actors with
    (the head that runs it has no GPU), give every prefill and decode actor its GPUs."""
    from router.types import Role
    from services.cluster.resources import gpus_per_worker
    from services.cluster.specs import worker_specs

    vllm = {"tensor_parallel_size": tensor_parallel} if tensor_parallel else {}
    values = {
        "config": {"engine": {"backend": "vllm", "device": "cuda", "vllm": vllm}},
        "prefill": {"gpus": gpus},
        "decode": {"gpus": gpus},
    }
    config = _rendered_config(render_fn(values))
    specs = worker_specs(config, lambda: None, None, cluster_has_gpus=False)  # type: ignore[arg-type,return-value]
    assert {s.role for s in specs} == {Role.PREFILL, Role.DECODE}
    assert all(s.num_gpus == gpus for s in specs)
    if tensor_parallel:  # a group too small for the engine is refused before any actor starts
        narrow = config.model_copy(
            update={"workers": config.workers.model_copy(update={"gpus_per_role": {"prefill": 1}})}
        )
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            gpus_per_worker(narrow, Role.PREFILL, cluster_has_gpus=True)


def test_cpu_worker_groups_ask_for_no_gpus(render_fn: Any) -> None:
    from router.types import Role
    from services.cluster.resources import gpus_per_worker

    values = {"prefill": {"gpus": 0}, "decode": {"gpus": 0}}
    config = _rendered_config(render_fn(values))
    assert gpus_per_worker(config, Role.DECODE, cluster_has_gpus=True) == 0


def test_the_encode_group_starts_encode_workers_with_a_kv_connector(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    """epd-values: the chart's config makes the encode group's pods' Ray resources into
    encode workers, which hold embeddings in kvtransfer region ``mm`` for prefill."""
    from router.types import Role
    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    config_map = one(rendered_sets["epd-values"], "ConfigMap")
    config = ClusterConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.engine.backend == "embedded" and config.workers.mode == "disaggregated"
    specs = worker_specs(config, *factories_for(config))
    encoders = [s for s in specs if s.role is Role.ENCODE]
    assert len(encoders) == config.workers.encode >= 1
    assert all(s.connector_factory is not None for s in encoders)
