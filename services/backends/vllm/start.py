"""Starting vLLM for a worker: engine arguments from Baton's config, and vLLM's
NixlConnector when the worker takes part in P/D.

The connector's role is ``kv_both``, so a worker can flip between prefill and
decode; a pull that fails (the prefill worker died after its first token) makes the
decoder compute the prompt itself, so greedy text is unchanged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

from kvtransfer.net import advertised_host, free_port
from services.backends.protocol import AdmissionPolicy
from services.backends.vllm.engine import VllmEngine
from services.backends.vllm.images import allow_llava_without_torchvision
from services.backends.vllm.options import check_vllm_options
from services.config import EngineConfig, ModelConfig
from services.engine.messages import ModelLoadError
from services.engine.placeholders import read_image_prompt_spec

__all__ = ["make_vllm_engine", "vllm_engine_args"]


def vllm_engine_args(
    model_cfg: ModelConfig, engine_cfg: EngineConfig, *, on_cpu: bool, takes_embeddings: bool
) -> dict[str, Any]:
    """vLLM's ``EngineArgs`` keywords for Baton's config: the model, the engine settings
    the two engines share (``long_prefill_token_threshold`` included), then
    ``engine.vllm``'s options (checked), which override them. ``takes_embeddings``: a
    LLaVA served from encode workers' embeddings as they are."""
    options = dict(engine_cfg.vllm)
    check_vllm_options(options)
    args: dict[str, Any] = {
        "model": model_cfg.name,
        "seed": model_cfg.seed,
        "dtype": model_cfg.dtype,
        "max_model_len": engine_cfg.max_model_len,
        "max_num_seqs": engine_cfg.max_num_seqs,
        "max_num_batched_tokens": engine_cfg.max_num_batched_tokens,
        "long_prefill_token_threshold": engine_cfg.long_prefill_token_threshold,
        "enable_prefix_caching": engine_cfg.enable_prefix_caching,
    }  # block size: vLLM's default for the platform (CPU attention needs a multiple of 32)
    if on_cpu:
        args["kv_cache_memory_bytes"] = engine_cfg.kv_cache_bytes
    if takes_embeddings:  # LLaVA: take encode workers' embeddings as they are
        args["enable_mm_embeds"] = True
    # Compact JSON, as the embedded engine writes it by default (a weak model allowed
    # free whitespace wandered into it until max_tokens). vLLM reads this per engine,
    # not per request, and only with xgrammar or guidance named: xgrammar, the grammar
    # engine the embedded engine uses, so both accept the same schemas.
    # engine.vllm's keys override these one by one.
    structured = {"backend": "xgrammar", "disable_any_whitespace": True}
    own = options.pop("structured_outputs_config", None)
    args.update(options)
    if own is None or isinstance(own, Mapping):
        from vllm.config import StructuredOutputsConfig

        own = StructuredOutputsConfig(**{**structured, **(own or {})})
    args["structured_outputs_config"] = own
    return args


def make_vllm_engine(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    admission: AdmissionPolicy | None = None,
    *,
    kv_lease_s: float | None = None,
) -> VllmEngine:
    """Start vLLM on ``model_cfg.name`` (a local folder).

    ``kv_lease_s`` set: this worker takes part in P/D; vLLM's NixlConnector is
    enabled (role ``kv_both``, so the worker can flip between prefill and decode)
    with that lease on held prefill blocks. ``admission`` is the embedded engine's
    hook; vLLM admits by its own scheduler.
    """
    del admission
    if not os.path.isdir(model_cfg.name):
        raise ModelLoadError(
            f"the vllm backend loads a local model folder; {model_cfg.name!r} is not one "
            "(the built-in 'tiny' model is the embedded engine's)"
        )
    on_cpu = engine_cfg.device == "cpu" or (
        engine_cfg.device == "auto" and not torch.cuda.is_available()
    )
    image_spec = read_image_prompt_spec(model_cfg.name)
    args = vllm_engine_args(
        model_cfg, engine_cfg, on_cpu=on_cpu, takes_embeddings=image_spec is not None
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    allow_llava_without_torchvision()

    if kv_lease_s is not None:
        from vllm.config import KVTransferConfig

        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = advertised_host()
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(""))
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu" if on_cpu else "cuda",
            kv_connector_extra_config={"kv_lease_duration": max(1, math.ceil(kv_lease_s))},
            # A pull that fails (the prefill worker died after its first token):
            # the decoder computes the prompt itself; greedy text is unchanged.
            kv_load_failure_policy="recompute",
        )
    name = model_cfg.served_model_name or model_cfg.name
    engine_args = EngineArgs(**args)
    try:
        llm = LLMEngine.from_engine_args(engine_args)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(f"vLLM could not start on {model_cfg.name!r}: {e}") from e
    shape = None
    if image_spec is not None:
        hidden = int(llm.vllm_config.model_config.get_hidden_size())
        shape = (image_spec.num_image_tokens, hidden)
    return VllmEngine(llm, name, image_embedding_shape=shape)
