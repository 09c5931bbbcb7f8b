"""values.schema.json refuses bad values with a message naming the key, and the chart's
own checks refuse what a schema cannot express."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python
import pytest
from pydantic import BaseModel

from services.config import ClusterConfig
from tests.unit.deploy.conftest import CHART, VALUE_SETS, load_values

# Keys of the ClusterConfig the chart sets itself, so values may not.
CHART_OWNED = {
    "workers": {"prefill", "decode", "encode", "mixed", "gpus_per_role"},
    "gateway": {"host", "port", "api_key", "api_keys_file"},
}


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"prefill": {"replicas": -1}}, "replicas"),
        ({"decode": {"maxReplicas": -3}}, "maxReplicas"),
        ({"extraWorkerGroups": [{"name": "x", "role": "verifier"}]}, "role"),
        ({"extraWorkerGroups": [{"name": "Bad_Name", "role": "decode"}]}, "name"),
        ({"extraWorkerGroups": [{"role": "decode"}]}, "name"),
        ({"decode": {"gpus": "two"}}, "gpus"),
        ({"workerDefaults": {"workersPerPod": 0}}, "workersPerPod"),
        ({"prefil": {"replicas": 1}}, "prefil"),
        ({"decode": {"replica": 2}}, "replica"),
        ({"rdma": {"enabled": "yes"}}, "enabled"),
        ({"shm": {"sizeLimit": 8}}, "sizeLimit"),
        ({"service": {"port": 0}}, "port"),
        ({"model": {"source": "s3"}}, "source"),
        ({"autoscaling": {"mode": "hpa"}}, "mode"),
        ({"gateway": {"probes": {"readiness": {"path": "health"}}}}, "path"),
        ({"gateway": {"replicas": 0}}, "replicas"),
        ({"head": {"probes": {}}}, "probes"),
        ({"config": {"engine": {"backnd": "vllm"}}}, "backnd"),
        ({"config": {"engine": {"block_size": 0}}}, "block_size"),
        ({"config": {"kvtransfer": {"backend": "carrier-pigeon"}}}, "backend"),
        ({"config": {"workers": {"prefill": 3}}}, "prefill"),
    ],
)
def test_invalid_values_are_refused_naming_the_key(
    chart: helm_python.Chart, values: dict[str, Any], key: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError) as info:
        chart.validate_schema(values)
    assert key in str(info.value)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_shipped_value_set_passes_the_schema(chart: helm_python.Chart, name: str) -> None:
    chart.validate_schema(load_values(name))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"extraWorkerGroups": [{"name": "decode", "role": "decode"}]}, '"decode" is used twice'),
        ({"prefill": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) > maxReplicas (2)"),
        ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
        ({"model": {"source": "download"}}, "model.download.repoId is required"),
        ({"decode": {"enabled": False}}, "at least one prefill and one decode"),
    ],
)
def test_the_templates_refuse_what_the_schema_cannot_express(
    render_fn: Callable[[dict[str, Any]], list[dict[str, Any]]],
    values: dict[str, Any],
    message: str,
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match="execution error") as info:
        render_fn(values)
    assert message in str(info.value)


def test_config_section_of_the_schema_matches_cluster_config(chart: helm_python.Chart) -> None:
    """Every ClusterConfig field the chart does not own can be set in values.config, and
    nothing else can (so a renamed field breaks this test, not a deployment)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]

    def keys(node: dict[str, Any], model: type[BaseModel], section: str) -> None:
        expected = set(model.model_fields) - CHART_OWNED.get(section, set())
        assert set(node["properties"]) == expected, section
        assert node["additionalProperties"] is False
        for field, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel) and field in node["properties"]:
                keys(node["properties"][field], sub, field)

    keys(schema, ClusterConfig, "")
