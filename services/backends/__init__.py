"""Engine backends by name. Each entry is imported only when asked for (vLLM is heavy)."""

from __future__ import annotations

import importlib
from typing import Any

from services.backends.protocol import AdmissionPolicy, Engine
from services.config import EngineConfig, ModelConfig

__all__ = ["BACKENDS", "MOVES_OWN_KV", "make_engine"]

# name -> "module:factory"; a factory takes (model_cfg, engine_cfg, admission) -> Engine.
BACKENDS: dict[str, str] = {
    "embedded": "services.backends.embedded:make_embedded_engine",
    "vllm": "services.backends.vllm.start:make_vllm_engine",
    "fake": "services.backends.fake:make_fake_engine",  # tests: no model
}
# Backends whose engine moves KV between workers itself (vLLM's NixlConnector):
# their workers get no kvtransfer connector, and the engine is told the lease.
MOVES_OWN_KV = frozenset({"vllm"})


def make_engine(
    backend: str,
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    admission: AdmissionPolicy | None = None,
    *,
    kv_lease_s: float | None = None,
) -> Engine:
    """Build the engine registered as ``backend`` (ValueError naming the known ones otherwise)."""
    target = BACKENDS.get(backend)
    if target is None:
        raise ValueError(f"unknown engine backend {backend!r}; known: {sorted(BACKENDS)}")
    module_name, factory_name = target.split(":")
    factory: Any = getattr(importlib.import_module(module_name), factory_name)
    if backend in MOVES_OWN_KV:
        engine: Engine = factory(model_cfg, engine_cfg, admission, kv_lease_s=kv_lease_s)
    else:
        engine = factory(model_cfg, engine_cfg, admission)
    return engine
