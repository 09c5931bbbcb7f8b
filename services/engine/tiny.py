"""The built-in ``tiny`` model: no files, seeded random weights, the byte tokenizer.

It exists so every test, the CI and a laptop can run the real engine end to
end in milliseconds. Its output is meaningless but deterministic: the same
seed gives the same weights on any machine and device.
"""

from __future__ import annotations

from typing import Any

import torch

from services.engine.config import ModelArgs
from services.engine.model import CausalLM
from services.engine.tokenizer import ByteTokenizer

__all__ = ["TINY_ARGS", "TINY_NAME", "build_tiny_model", "init_random", "tiny_hf_config"]

TINY_NAME = "tiny"

_TOKENIZER = ByteTokenizer()

TINY_ARGS = ModelArgs(
    architecture="LlamaForCausalLM",
    vocab_size=_TOKENIZER.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    qkv_bias=False,
    qk_norm=False,
    torch_dtype="float32",
    eos_token_ids=_TOKENIZER.eos_token_ids,
    bos_token_id=_TOKENIZER.bos_token_id,
)

_INIT_STD = 0.1  # larger than a trained model's 0.02, so greedy text is not one repeated byte


def build_tiny_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    args: ModelArgs = TINY_ARGS,
) -> CausalLM:
    """Weights are drawn on the CPU in float32 in parameter-name order, then cast and moved."""
    model = CausalLM(args)
    init_random(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def init_random(module: torch.nn.Module, seed: int) -> None:
    """Norm weights 1 and norm biases 0; every other tensor N(0, 0.1), drawn in name order."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if "norm" in name.rsplit(".", 2)[-2]:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * _INIT_STD)


def tiny_hf_config() -> Any:
    """The ``transformers`` LlamaConfig of the built-in model (its twin in tests and benchmarks)."""
    from transformers import LlamaConfig

    a = TINY_ARGS
    fields: dict[str, Any] = {
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,  # transformers 5 reads it from kwargs into rope_parameters
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
    }
    return LlamaConfig(**fields)
