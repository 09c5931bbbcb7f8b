"""Fixtures for the deploy tests: the chart rendered once per value set, the CRD schemas."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.unit.deploy.k8s_schemas import CRDSchemas

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "baton"
RELEASE, NAMESPACE = "rel", "llm"
# "defaults" plus every chart-testing value set in helm/baton/ci/.
VALUE_SETS: dict[str, Path | None] = {
    "defaults": None,
    **{p.name.removesuffix(".yaml"): p for p in sorted((CHART / "ci").glob("*.yaml"))},
}


def _shared_dir() -> Path:
    """``<repo>/../shared``; a git worktree looks beside its main checkout too."""
    candidates = [REPO.parent / "shared"]
    try:
        common = subprocess.run(
            ["git", "rev-parse", "--path-format=absolute", "--git-common-dir"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:  # no git: only the plain layout
        common = None
    if common is not None and common.returncode == 0:
        candidates.append(Path(common.stdout.strip()).parent.parent / "shared")
    for candidate in candidates:
        if (candidate / "crds").is_dir():
            return candidate
    raise AssertionError(f"shared/crds not found in {candidates}: clone shared/ beside the repo")


def load_values(name: str) -> dict[str, Any]:
    path = VALUE_SETS[name]
    return {} if path is None else yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's objects for these values (NOTES.txt and disabled templates dropped)."""
    out = helm_python.Chart.load(str(CHART)).render(
        values, name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith((".yaml", ".yml")) and text.strip()
        for doc in yaml.safe_load_all(text)
        if doc
    ]


@pytest.fixture(scope="session")
def crd_schemas() -> CRDSchemas:
    return CRDSchemas.load(_shared_dir() / "crds")


@pytest.fixture(scope="session")
def rendered_sets() -> dict[str, list[dict[str, Any]]]:
    """Every value set rendered once for the whole session."""
    return {name: render(load_values(name)) for name in VALUE_SETS}


@pytest.fixture(scope="session")
def render_fn() -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    return render
