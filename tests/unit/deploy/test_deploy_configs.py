"""The example ClusterConfigs in deploy/configs parse and describe the layout they claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import ClusterConfig, load_config
from tests.unit.deploy.conftest import REPO

CONFIGS = sorted((REPO / "deploy" / "configs").glob("*.yaml"))


def test_the_shipped_examples_are_all_there() -> None:
    assert {p.name for p in CONFIGS} >= {"local.yaml", "gpu-2p2d.yaml", "epd.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_as_a_cluster_config(path: Path) -> None:
    assert isinstance(load_config(path), ClusterConfig)


def test_local_runs_the_tiny_model_on_cpu() -> None:
    config = load_config(REPO / "deploy" / "configs" / "local.yaml")
    assert (config.model.name, config.engine.backend, config.engine.device) == (
        "tiny",
        "embedded",
        "cpu",
    )


def test_gpu_2p2d_is_two_prefill_two_decode_on_vllm_with_nixl() -> None:
    config = load_config(REPO / "deploy" / "configs" / "gpu-2p2d.yaml")
    workers = config.workers
    assert (workers.mode, workers.prefill, workers.decode, workers.num_gpus) == (
        "disaggregated",
        2,
        2,
        1,
    )
    assert (config.engine.backend, config.engine.device, config.kvtransfer.backend) == (
        "vllm",
        "cuda",
        "nixl",
    )


def test_epd_has_encode_prefill_and_decode_workers() -> None:
    workers = load_config(REPO / "deploy" / "configs" / "epd.yaml").workers
    assert min(workers.encode, workers.prefill, workers.decode) >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_names_an_existing_backend(path: Path) -> None:
    from services.backends import BACKENDS

    assert load_config(path).engine.backend in BACKENDS


def test_unknown_vllm_engine_arguments_are_refused_by_name() -> None:
    from services.cluster.serve import check_backend_options

    config = ClusterConfig().with_overrides(
        {"engine.backend": "vllm", "engine.vllm": {"enforce_eager": True, "max_batch_sizee": 8}}
    )
    with pytest.raises(ValueError, match="max_batch_sizee"):
        check_backend_options(config)
    reserved = config.with_overrides({"engine.vllm": {"model": "/elsewhere"}})
    with pytest.raises(ValueError, match="model"):
        check_backend_options(reserved)
    check_backend_options(config.with_overrides({"engine.vllm": {"enforce_eager": True}}))
    embedded = ClusterConfig().with_overrides({"engine.vllm": {"enforce_eager": True}})
    with pytest.raises(ValueError, match=r"engine\.backend"):
        check_backend_options(embedded)
