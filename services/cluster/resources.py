"""What each worker actor asks Ray for: one rule, used by `baton serve` and by the chart's tests."""

from __future__ import annotations

from router.types import Role
from services.config import ClusterConfig

__all__ = ["gpus_per_worker", "tensor_parallel_gpus"]


def tensor_parallel_gpus(config: ClusterConfig) -> int:
    """GPUs one engine spans (vLLM's tensor x pipeline parallel size; 1 otherwise)."""
    if config.engine.backend != "vllm":
        return 1
    options = config.engine.vllm
    tp = int(options.get("tensor_parallel_size", 1) or 1)
    pp = int(options.get("pipeline_parallel_size", 1) or 1)
    return tp * pp


def gpus_per_worker(config: ClusterConfig, role: Role, *, cluster_has_gpus: bool) -> float:
    """GPUs for one worker actor of ``role``.

    Explicit settings win (``workers.gpus_per_role``, rendered by the chart from its
    worker groups, then ``workers.num_gpus``) and must cover the engine's
    tensor/pipeline parallel size. Otherwise a worker gets that many GPUs when
    the engine runs on CUDA (``engine.device: cuda``, or ``auto`` on a Ray
    cluster with GPUs), and none on CPU. The head that computes this may itself
    have no GPU: the cluster's resources decide, not the local device.
    """
    w = config.workers
    needed = tensor_parallel_gpus(config)
    explicit = w.gpus_per_role.get(role.value)  # type: ignore[call-overload]
    if explicit is None:
        explicit = w.num_gpus
    if explicit is not None:
        if 0 < explicit < needed:
            raise ValueError(
                f"{role.value} workers get {explicit:g} GPU(s) but the engine spans {needed} "
                "(engine.vllm tensor_parallel_size x pipeline_parallel_size)"
            )
        return float(explicit)
    device = config.engine.device
    on_gpu = device == "cuda" or (device == "auto" and cluster_has_gpus)
    return float(needed) if on_gpu else 0.0
