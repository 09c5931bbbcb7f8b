"""Fixtures that build tiny random Hugging Face checkpoints on disk (the parity oracle)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from loadgen.scripts import load_script

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = ["hello", "world", "the", "a", "cat", "sat", "on", "mat", "<|user|>", "<|assistant|>"]


# The one word-level tokenizer and LLaVA checkpoint builders: benchmarks/checkpoints.py's.
_BUILDERS = load_script(
    Path(__file__).resolve().parents[3] / "benchmarks" / "checkpoints.py", "bench_checkpoints"
)
word_tokenizer = _BUILDERS.word_tokenizer
save_random_llava = _BUILDERS.save_random_llava


def save_byte_level_tokenizer(folder: Path) -> None:
    """GPT-2 style byte-level BPE: the 256 byte characters (ids 0-255) and one word,
    ``Ġhi`` (256): it can write any text, JSON included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from services.gateway.token_bytes import _byte_level_decoder

    to_char = {b: c for c, b in _byte_level_decoder().items()}
    vocab = {to_char[b]: b for b in range(256)} | {"Ġhi": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over `vocab_size` ids: specials, a few words, then filler words."""
    words = ["<unk>", "<s>", "</s>", *WORDS]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = word_tokenizer(words, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))


def _config(kind: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    match kind:
        case "llama" | "llama_sharded":
            return LlamaConfig(**common, head_dim=16, rope_theta=10000.0)
        case "llama3_rope":
            scaling = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            }
            return LlamaConfig(**common, head_dim=16, rope_parameters=scaling)
        case "mistral":
            return MistralConfig(**common, head_dim=16, sliding_window=5)
        case "qwen2":
            return Qwen2Config(**{**common, "tie_word_embeddings": True})
        case "qwen3":
            return Qwen3Config(**common, head_dim=16, attention_bias=False)
        case _:
            raise ValueError(kind)


def _scramble(model: torch.nn.Module, seed: int) -> None:
    # The default init (std 0.02, norms at 1) makes logits nearly flat, so a wrong model
    # could still agree within 1e-4. Larger random weights and non-unit norms expose it.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@dataclass
class HFCheckpoint:
    kind: str
    folder: Path
    model: Any  # the transformers model, float32, eval

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(torch.tensor([token_ids]))
        return out.logits[0].float()


def build_checkpoint(kind: str, folder: Path, seed: int = 0) -> HFCheckpoint:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _config(kind)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _scramble(model, seed)
    model = model.float().eval()
    if kind == "llama_sharded":
        model.save_pretrained(str(folder), max_shard_size="40KB")
    else:
        model.save_pretrained(str(folder))
    save_word_tokenizer(folder, config.vocab_size)
    return HFCheckpoint(kind, folder, model)


@pytest.fixture(scope="session")
def hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], HFCheckpoint]:
    """hf_checkpoint(kind) -> a saved tiny checkpoint, built once per session per kind."""
    cache: dict[str, HFCheckpoint] = {}

    def get(kind: str) -> HFCheckpoint:
        if kind not in cache:
            cache[kind] = build_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get
