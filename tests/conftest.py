"""Shared fixtures. Tiers: unit (pure, ms), contract, integration (local Ray), e2e (real server), gpu."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """ONE local Ray cluster for the whole test session; yields its GCS address."""
    import ray

    ray.init(
        num_cpus=4,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
        namespace="baton-tests",
    )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
