"""The Helm chart: strict lint, strict schema validation of every object, and the
properties a GPU deployment depends on, for the defaults and every ci/ value set."""

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
    one,
    pods,
    ray_resources,
)
from tests.unit.deploy.conftest import CHART, NAMESPACE, VALUE_SETS, load_values
from tests.unit.deploy.gateway_routes import gateway_routes
from tests.unit.deploy.k8s_schemas import CRDSchemas, SchemaMissingError, validate_object

SETS = list(VALUE_SETS)
ROLES = {"prefill", "decode", "encode", "mixed"}


def _docs(rendered_sets: dict[str, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return rendered_sets[name]


def _resources(container: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    res = container.get("resources", {})
    return res.get("requests", {}), res.get("limits", {})


# --- lint and schemas -------------------------------------------------------------------


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
    docs = _docs(rendered_sets, name)
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


# --- pods and resources ----------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_gpu_limits_equal_requests_and_match_the_group(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    values = load_values(name)
    defaults_gpus = values.get("workerDefaults", {}).get("gpus", 1)
    for pod in pods(_docs(rendered_sets, name)):
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            requests, limits = _resources(container)
            assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu"), pod.group
        if pod.is_worker:
            group = _group_values(values, pod.group)
            expected = group.get("gpus", defaults_gpus)
            requests, limits = _resources(pod.main)
            assert limits.get("nvidia.com/gpu", "0") == str(expected), pod.group


def _group_values(values: dict[str, Any], group: str) -> dict[str, Any]:
    if group in ("prefill", "decode", "encode"):
        return dict(values.get(group, {}))
    return next(g for g in values.get("extraWorkerGroups", []) if g["name"] == group)


@pytest.mark.parametrize("name", SETS)
def test_every_pod_mounts_a_memory_backed_dev_shm_with_a_size_limit(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    all_pods = list(pods(_docs(rendered_sets, name)))
    assert any(p.is_worker for p in all_pods)
    for pod in all_pods:
        mounts = {m["mountPath"]: m["name"] for m in pod.main["volumeMounts"]}
        assert "/dev/shm" in mounts, pod.group
        volume = next(v for v in pod.spec["volumes"] if v["name"] == mounts["/dev/shm"])
        assert volume["emptyDir"]["medium"] == "Memory"
        assert re.fullmatch(r"[0-9]+[KMGT]i", volume["emptyDir"]["sizeLimit"])


def test_a_group_can_override_the_shm_size(rendered_sets: dict[str, list[dict[str, Any]]]) -> None:
    sizes = {
        p.group: next(v for v in p.spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        for p in pods(rendered_sets["large-multigroup-values"])
    }
    assert sizes["head"] == "8Gi" and sizes["decode-b200"] == "64Gi"


@pytest.mark.parametrize("name", SETS)
def test_rdma_resource_and_ipc_lock_exactly_when_enabled(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    rdma = {"enabled": False, "resourceName": "rdma/ib", "count": 1} | load_values(name).get(
        "rdma", {}
    )
    for pod in pods(_docs(rendered_sets, name)):
        requests, limits = _resources(pod.main)
        caps = pod.main["securityContext"].get("capabilities", {}).get("add", [])
        if rdma["enabled"] and pod.is_worker:
            assert requests[rdma["resourceName"]] == limits[rdma["resourceName"]]
            assert limits[rdma["resourceName"]] == str(rdma["count"])
            assert "IPC_LOCK" in caps
        else:
            assert not any(k.startswith("rdma/") for k in {**requests, **limits}), pod.group
            assert "IPC_LOCK" not in caps


def test_rdma_is_enabled_by_at_least_one_value_set() -> None:
    assert any(load_values(n).get("rdma", {}).get("enabled") for n in SETS)


@pytest.mark.parametrize("name", SETS)
def test_workers_get_pod_ip_and_nixl_env_from_the_downward_api(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    values = load_values(name)
    for pod in pods(_docs(rendered_sets, name)):
        env = {e["name"]: e for e in pod.main["env"]}
        for var in ("BATON_POD_IP", "VLLM_NIXL_SIDE_CHANNEL_HOST"):
            assert env[var]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["BATON_ROLE"]["value"] == pod.role
        # UCX_TLS is always explicit: the value set's, else the chart's default.
        ucx_tls = values.get("nixl", {}).get("ucxTls", "tcp,sm,self,cuda_copy,cuda_ipc")
        assert env["UCX_TLS"]["value"] == ucx_tls
        # Ray token authentication on every pod, from one Secret, so pods join and
        # nothing outside the release can submit work.
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"


@pytest.mark.parametrize("name", SETS)
def test_pods_run_as_non_root_without_privilege_escalation(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    for pod in pods(_docs(rendered_sets, name)):
        assert pod.spec["securityContext"]["runAsNonRoot"] is True
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]


# --- worker groups, Ray resources and autoscaling -----------------------------------------


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
    docs = _docs(rendered_sets, name)
    values = load_values(name)
    per_pod_default = values.get("workerDefaults", {}).get("workersPerPod", 1)
    workers = [p for p in pods(docs) if p.is_worker]
    assert {"prefill", "decode"} <= {p.role for p in workers}
    for pod in workers:
        assert pod.role in ROLES
        expected = _group_values(values, pod.group).get("workersPerPod", per_pod_default)
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
    docs = _docs(rendered_sets, name)
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
    docs = _docs(rendered_sets, name)
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
    docs = _docs(rendered_sets, name)
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


# --- gateway, traffic and disruption -------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_gateway_probes_hit_routes_the_gateway_serves(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = _docs(rendered_sets, name)
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
def test_the_gateway_is_its_own_deployment_of_two_and_the_head_runs_only_ray_and_the_controller(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = _docs(rendered_sets, name)
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


@pytest.mark.parametrize("name", SETS)
def test_the_gateways_have_a_disruption_budget_keeping_one_serving(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = _docs(rendered_sets, name)
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
    env = {e["name"]: e for e in gateway_pod(_docs(rendered_sets, name)).main["env"]}
    for pod in pods(_docs(rendered_sets, name)):  # no other pod holds the key
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
    docs = _docs(rendered_sets, name)
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
    docs = _docs(rendered_sets, name)
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
    docs = _docs(rendered_sets, name)
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


def test_model_download_init_container_fills_the_volume_the_workers_read(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    for pod in pods(rendered_sets["epd-values"]):
        (init,) = pod.spec["initContainers"]
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        main_mounts = {m["name"]: m for m in pod.main["volumeMounts"]}
        assert init_mounts["model"] == main_mounts["model"]["mountPath"]
        assert main_mounts["model"].get("readOnly") is True
        env = {e["name"]: e for e in init["env"]}
        assert env["MODEL_REPO_ID"]["value"] == "llava-hf/llava-1.5-7b-hf"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}


def test_a_pvc_model_source_mounts_the_claim_read_only(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    for pod in pods(rendered_sets["rdma-values"]):
        volume = next(v for v in pod.spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
        assert "initContainers" not in pod.spec


def _rendered_config(docs: list[dict[str, Any]]) -> ClusterConfig:
    config_map = one(docs, "ConfigMap")
    return ClusterConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))


@pytest.mark.parametrize("name", SETS)
def test_every_value_set_names_an_existing_backend(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    from services.backends import BACKENDS

    assert _rendered_config(_docs(rendered_sets, name)).engine.backend in BACKENDS


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


@pytest.mark.parametrize("name", SETS)
def test_ray_token_secret_and_no_dashboard_outside_the_pod(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    docs = _docs(rendered_sets, name)
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


def test_the_encode_group_starts_encode_workers_with_a_kv_connector(
    rendered_sets: dict[str, list[dict[str, Any]]],
) -> None:
    """epd-values: the chart's config makes the encode group's pods' Ray resources into
    encode workers, which hold embeddings in kvtransfer region ``mm`` for prefill."""
    from router.types import Role
    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    config_map = one(_docs(rendered_sets, "epd-values"), "ConfigMap")
    config = ClusterConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.engine.backend == "embedded" and config.workers.mode == "disaggregated"
    specs = worker_specs(config, *factories_for(config))
    encoders = [s for s in specs if s.role is Role.ENCODE]
    assert len(encoders) == config.workers.encode >= 1
    assert all(s.connector_factory is not None for s in encoders)
