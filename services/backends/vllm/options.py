"""``engine.vllm``: extra keyword arguments for vLLM's ``EngineArgs``, checked by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["RESERVED_OPTIONS", "check_vllm_options"]

# Set by Baton from its own config; naming them in engine.vllm would fight that config.
RESERVED_OPTIONS = frozenset({"model", "seed", "kv_transfer_config", "served_model_name"})


def check_vllm_options(options: Mapping[str, Any]) -> None:
    """Raise ValueError naming every key that vLLM's EngineArgs does not take.

    Imports vLLM's argument module (seconds, no engine): call it once at start.
    """
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise ValueError(
            f"engine.vllm: unknown vLLM engine argument(s) {unknown}; "
            "see vllm.engine.arg_utils.EngineArgs for the names"
        )
    reserved = sorted(k for k in options if k in RESERVED_OPTIONS)
    if reserved:
        raise ValueError(
            f"engine.vllm: {reserved} are set by Baton (model.name, model.seed, "
            "model.served_model_name, kvtransfer); set them there instead"
        )
