"""The Grafana dashboard, the alert rules and the chart's KEDA queries use only metrics
the code exports, and the rules pass promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram, generate_latest

from services.metrics import BatonMetrics
from tests.unit.deploy.chart_objects import by_kind
from tests.unit.deploy.conftest import CHART, REPO

DASHBOARD = REPO / "deploy" / "grafana" / "baton.json"
RULES = REPO / "deploy" / "prometheus" / "baton-rules.yaml"
RULES_TESTS = REPO / "deploy" / "prometheus" / "baton-rules.test.yaml"
# A metric name: baton_ not preceded by a name character (so recorded "baton:..." series
# and words like "xbaton_" do not count).
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])baton_[a-z0-9_]+")


def exported_sample_names() -> set[str]:
    """Every sample name a live BatonMetrics exposes once each metric has a value."""
    metrics = BatonMetrics()
    for metric in vars(metrics).values():
        if not isinstance(metric, Counter | Gauge | Histogram):
            continue
        # _labelnames is prometheus_client's record of the label names given at creation.
        labelnames: tuple[str, ...] = metric._labelnames
        child = metric.labels(**{n: f"sample-{n}" for n in labelnames}) if labelnames else metric
        match child:
            case Histogram():
                child.observe(0.01)
            case Counter():
                child.inc()
            case Gauge():
                child.set(1)
    text = generate_latest(metrics.registry).decode()
    return {
        re.split(r"[{\s]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _exprs(node: Any) -> list[str]:
    """Every PromQL string in a dashboard or rules document ("expr" and variable queries)."""
    match node:
        case dict():
            found = [
                v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)
            ]
            return found + [e for v in node.values() for e in _exprs(v)]
        case list():
            return [e for v in node for e in _exprs(v)]
    return []


def _keda_queries() -> list[str]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return [t["query"] for t in values["autoscaling"]["keda"]["triggers"].values()]


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_sample_names()


def test_the_live_registry_exposes_suffixed_names(exported: set[str]) -> None:
    # The conventions the dashboard relies on: counters get _total, histograms _bucket.
    assert "baton_request_slo_total" in exported
    assert "baton_time_to_first_token_seconds_bucket" in exported
    assert "baton_gateway_inflight_requests" in exported
    assert "baton_request_slo" not in exported


@pytest.mark.parametrize(
    "source",
    ["dashboard", "rules", "keda-values", "keda-rendered"],
)
def test_every_queried_metric_is_exported(
    source: str, exported: set[str], rendered_sets: dict[str, list[dict[str, Any]]]
) -> None:
    match source:
        case "dashboard":
            exprs = _exprs(json.loads(DASHBOARD.read_text()))
        case "rules":
            exprs = _exprs(yaml.safe_load(RULES.read_text()))
        case "keda-values":
            exprs = _keda_queries()
        case _:
            exprs = [
                t["metadata"]["query"]
                for s in by_kind(rendered_sets["keda-values"], "ScaledObject")
                for t in s["spec"]["triggers"]
            ]
    names = {name for expr in exprs for name in _METRIC.findall(expr)}
    assert len(exprs) >= 3 and names, f"{source}: found no queries"
    assert names - exported == set()


def test_the_metric_name_parser_is_not_fooled() -> None:
    expr = (
        'sum(rate(baton_requests_total{outcome="x"}[5m])) / baton:goodput_ratio:rate5m + xbaton_y'
    )
    assert _METRIC.findall(expr) == ["baton_requests_total"]


def test_the_dashboard_shows_what_operators_need() -> None:
    text = json.dumps(_exprs(json.loads(DASHBOARD.read_text())))
    for needle in (
        'baton_request_slo_total{result=\\"met\\"}',  # goodput
        "histogram_quantile(0.99, sum by (le) (rate(baton_time_to_first_token_seconds_bucket",
        "baton_time_per_output_token_seconds_bucket",
        "sum by (stage)",  # waterfall
        "baton_worker_kv_blocks",
        "baton_kv_transfer_bytes_total",
        "baton_router_rejections_total",
        "baton_role_changes_total",
    ):
        assert needle in text, needle


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("promtool is missing under CI: .ci/run installs Debian's prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, check=False, timeout=60
    )


def test_rules_pass_promtool_check() -> None:
    result = _run(_promtool(), "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_behave_as_their_promtool_unit_tests_say() -> None:
    result = _run(_promtool(), "test", "rules", RULES_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_and_keda_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule, with Grafana's variables filled in."""
    grafana_vars = {"$__rate_interval": "5m", "$model": ".*"}
    exprs = _exprs(json.loads(DASHBOARD.read_text())) + _keda_queries()
    rules = []
    for i, expr in enumerate(exprs):
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        if expr.startswith("label_values("):  # a Grafana variable query, not PromQL
            continue
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run(_promtool(), "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_dashboard_panels_have_unique_ids_and_queries() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"


def test_promtool_check_refuses_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "groups:\n- name: x\n  rules:\n  - alert: A\n    expr: sum(rate(baton_requests_total[5m])\n"
    )
    assert _run(_promtool(), "check", "rules", broken).returncode != 0
