"""Engine backends by name. Each entry is imported only when asked for (vLLM is heavy)."""

from __future__ import annotations

import importlib
from typing import Any

from services.backends.protocol import AdmissionPolicy, Engine
from services.config import EngineConfig, ModelConfig

__all__ = ["BACKENDS", "make_engine"]

# name -> "module:factory"; a factory takes (model_cfg, engine_cfg, admission) -> Engine.
BACKENDS: dict[str, str] = {
    "embedded": "services.backends.embedded:make_embedded_engine",
}


def make_engine(
    backend: str,
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    admission: AdmissionPolicy | None = None,
) -> Engine:
    """Build the engine registered as ``backend`` (ValueError naming the known ones otherwise)."""
    target = BACKENDS.get(backend)
    if target is None:
        raise ValueError(f"unknown engine backend {backend!r}; known: {sorted(BACKENDS)}")
    module_name, factory_name = target.split(":")
    factory: Any = getattr(importlib.import_module(module_name), factory_name)
    engine: Engine = factory(model_cfg, engine_cfg, admission)
    return engine
