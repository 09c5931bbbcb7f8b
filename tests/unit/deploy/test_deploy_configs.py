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


def test_epd_starts_encode_workers_that_hand_embeddings_over_kvtransfer() -> None:
    from router.types import Role
    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    config = load_config(REPO / "deploy" / "configs" / "epd.yaml")
    specs = worker_specs(config, *factories_for(config))
    encoders = [s for s in specs if s.role is Role.ENCODE]
    assert len(encoders) == config.workers.encode
    assert all(s.connector_factory is not None for s in encoders)  # region "mm" needs one


def test_epd_config_with_vllm_starts_encode_workers_on_baton_s_engine() -> None:
    from router.types import Role
    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    config = load_config(REPO / "deploy" / "configs" / "epd.yaml").with_overrides(
        {"engine.backend": "vllm"}
    )
    specs = worker_specs(config, *factories_for(config))
    encoders = [s for s in specs if s.role is Role.ENCODE]
    assert len(encoders) == config.workers.encode > 0
    assert all(s.engine_factory.backend == "embedded" for s in encoders)  # type: ignore[attr-defined]
    text = [s for s in specs if s.role is not Role.ENCODE]
    assert {s.engine_factory.backend for s in text} == {"vllm"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_names_an_existing_backend(path: Path) -> None:
    from services.backends import BACKENDS

    assert load_config(path).engine.backend in BACKENDS


def test_unknown_vllm_engine_arguments_are_refused_by_name() -> None:
    from services.cluster.serve import check_backend_options

    config = ClusterConfig().with_overrides(
        {
            "model.name": "/models/llama",  # vLLM serves a folder, not Baton's built-in tiny
            "engine.backend": "vllm",
            "engine.vllm": {"enforce_eager": True, "max_batch_sizee": 8},
        }
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
