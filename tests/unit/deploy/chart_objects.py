"""Views over a rendered chart: its pods, containers and worker groups, by role."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Pod", "by_kind", "gateway_pod", "one", "pods", "ray_resources"]


@dataclass(frozen=True, slots=True)
class Pod:
    """One pod template: the head, the gateways, a RayCluster worker group, or a worker
    Deployment."""

    source: str  # "head", "gateway", "raycluster", "deployment"
    group: str
    role: str
    template: dict[str, Any]

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def main(self) -> dict[str, Any]:
        return self.spec["containers"][0]

    @property
    def is_worker(self) -> bool:
        return self.source in ("raycluster", "deployment")


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pods(docs: list[dict[str, Any]]) -> Iterator[Pod]:
    cluster = one(docs, "RayCluster")["spec"]
    yield Pod("head", "head", "head", cluster["headGroupSpec"]["template"])
    for group in cluster.get("workerGroupSpecs", []):
        labels = group["template"]["metadata"]["labels"]
        yield Pod("raycluster", group["groupName"], labels["baton.io/role"], group["template"])
    for deployment in by_kind(docs, "Deployment"):
        labels = deployment["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] == "gateway":
            yield Pod("gateway", "gateway", "gateway", deployment["spec"]["template"])
            continue
        yield Pod(
            "deployment",
            labels["baton.io/group"],
            labels["baton.io/role"],
            deployment["spec"]["template"],
        )


def gateway_pod(docs: list[dict[str, Any]]) -> Pod:
    (pod,) = [p for p in pods(docs) if p.source == "gateway"]
    return pod


def ray_resources(value: str) -> dict[str, float]:
    """rayStartParams.resources as `ray start` and KubeRay's autoscaler read it: one layer of
    shell quoting around JSON."""
    assert value[0] == value[-1] and value[0] in "'\"", f"not shell-quoted: {value!r}"
    return dict(json.loads(value[1:-1].replace("\\", "")))


def container_resources(container: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A container's resource requests and limits."""
    res = container.get("resources", {})
    return res.get("requests", {}), res.get("limits", {})


def group_values(values: dict[str, Any], group: str) -> dict[str, Any]:
    """One worker group's values: a role's own section, or an extra group by name."""
    if group in ("prefill", "decode", "encode"):
        return dict(values.get(group, {}))
    return next(g for g in values.get("extraWorkerGroups", []) if g["name"] == group)
