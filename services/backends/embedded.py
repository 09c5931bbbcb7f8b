"""The ``embedded`` backend: our own engine (services/engine) in this process."""

from __future__ import annotations

import torch

from services.backends.protocol import AdmissionPolicy
from services.config import EngineConfig, ModelConfig
from services.engine.engine import LLMEngine
from services.engine.loader import load_model

__all__ = ["make_embedded_engine", "resolve_device"]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def make_embedded_engine(
    model_cfg: ModelConfig, engine_cfg: EngineConfig, admission: AdmissionPolicy | None = None
) -> LLMEngine:
    """Load the model named by ``model_cfg`` and wrap it in an LLMEngine sized by ``engine_cfg``."""
    if engine_cfg.num_threads is not None:
        torch.set_num_threads(engine_cfg.num_threads)
    torch.manual_seed(model_cfg.seed)
    loaded = load_model(
        model_cfg.name,
        dtype=model_cfg.dtype,
        device=resolve_device(engine_cfg.device),
        seed=model_cfg.seed,
    )
    if model_cfg.served_model_name is not None:
        loaded.name = model_cfg.served_model_name
    return LLMEngine(loaded, engine_cfg, seed=model_cfg.seed, admission=admission)
