"""The Helm chart's pods: GPUs, shared memory, RDMA, the downward API, security
context and the model volume, for the defaults and every ci/ value set."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.unit.deploy.chart_objects import (
    container_resources,
    group_values,
    pods,
)
from tests.unit.deploy.conftest import VALUE_SETS, load_values

SETS = list(VALUE_SETS)


@pytest.mark.parametrize("name", SETS)
def test_gpu_limits_equal_requests_and_match_the_group(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    values = load_values(name)
    defaults_gpus = values.get("workerDefaults", {}).get("gpus", 1)
    for pod in pods(rendered_sets[name]):
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            requests, limits = container_resources(container)
            assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu"), pod.group
        if pod.is_worker:
            group = group_values(values, pod.group)
            expected = group.get("gpus", defaults_gpus)
            requests, limits = container_resources(pod.main)
            assert limits.get("nvidia.com/gpu", "0") == str(expected), pod.group


@pytest.mark.parametrize("name", SETS)
def test_every_pod_mounts_a_memory_backed_dev_shm_with_a_size_limit(
    name: str, rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    all_pods = list(pods(rendered_sets[name]))
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
    for pod in pods(rendered_sets[name]):
        requests, limits = container_resources(pod.main)
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
    for pod in pods(rendered_sets[name]):
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
    for pod in pods(rendered_sets[name]):
        assert pod.spec["securityContext"]["runAsNonRoot"] is True
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["capabilities"]["drop"] == ["ALL"]


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
