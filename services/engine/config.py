"""Model hyper-parameters, read from a Hugging Face ``config.json``.

``ModelArgs`` is the one place that knows how the four supported families spell
their options (transformers 4 ``rope_theta``/``rope_scaling`` and transformers 5
``rope_parameters`` alike); everything below it reads plain fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.messages import UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelArgs"]

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    torch_dtype: str  # the checkpoint's dtype, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias=True
    sliding_window: int | None = None  # Mistral: attend to at most this many tokens

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Read a parsed ``config.json``; raise UnsupportedModelError for what we do not run."""
        arch = _architecture(cfg)
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"{arch}: hidden_act {hidden_act!r} (only 'silu')")
        if cfg.get("mlp_bias", False):
            raise UnsupportedModelError(f"{arch}: mlp_bias=True is not supported")
        if arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window", False):
            raise UnsupportedModelError(f"{arch}: use_sliding_window=True is not supported")
        num_heads = int(cfg["num_attention_heads"])
        hidden_size = int(cfg["hidden_size"])
        attention_bias = bool(cfg.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(cfg, arch)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=_int_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            o_proj_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    # The loader reads LLaVA folders itself (services/engine/llava.py), then its text_config here.
    supported = ", ".join((*SUPPORTED_ARCHITECTURES, "LlavaForConditionalGeneration"))
    if not archs:
        raise UnsupportedModelError(
            f"config.json names no architecture (model_type={cfg.get('model_type')!r}); "
            f"supported: {supported}"
        )
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {supported}")
    return arch


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds theta and scaling into rope_parameters; 4 keeps them apart.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{arch}: rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    return theta, {**params, "rope_type": rope_type}


def _int_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    match value:
        case None:
            return ()
        case int():
            return (value,)
        case _:
            return tuple(int(v) for v in value)
