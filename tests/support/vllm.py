"""vLLM in tests: a checkpoint it can run, and engines hosted in Ray actors.

vLLM's in-process engine initialises process-wide state (its distributed group),
so each engine lives in its own Ray actor process; ``RemoteEngine`` drives one
through the Engine protocol with blocking calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.config import EngineConfig, ModelConfig


def vllm_llama_config(vocab_size: int) -> Any:
    """A tiny Llama that vLLM's CPU attention runs (head_dim 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )


def vllm_serve_args(checkpoint: Path, folder: Path, lease_s: float, *layout: str) -> list[str]:
    """``baton serve`` arguments for the vLLM backend on ``checkpoint`` (CPU, eager, a
    small KV cache, round_robin), the config written into ``folder``; ``layout``: the
    worker flags."""
    import yaml

    config = folder / "vllm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engine": {
                    "vllm": {"enforce_eager": True},
                    "max_model_len": 512,
                    "kv_cache_bytes": 8 * 2**20,
                    "device": "cpu",
                },
                "kvtransfer": {"lease_s": lease_s},
                "router": {"policy": "round_robin"},
                "workers": {"num_cpus": 0},
            }
        )
    )
    return [
        "--config", str(config), "--backend", "vllm", "--model", str(checkpoint),
        "--served-model-name", "m", "--dtype", "float32", "--log-level", "warning", *layout,
    ]  # fmt: skip


def build_vllm_checkpoint(folder: Path, seed: int = 0, *, byte_level: bool = False) -> Path:
    """A random-weight Llama that vLLM's CPU attention runs (head_dim 64), with a
    word-level tokenizer and chat template, saved by ``transformers``; ``byte_level``:
    a byte-level tokenizer instead, which can write JSON (no chat template)."""
    from transformers import AutoModelForCausalLM

    from tests.unit.engine.conftest import (
        _scramble,
        save_byte_level_tokenizer,
        save_word_tokenizer,
    )

    torch.manual_seed(seed)
    config = vllm_llama_config(257 if byte_level else 96)
    model = AutoModelForCausalLM.from_config(config)
    _scramble(model, seed)
    model.float().save_pretrained(str(folder))
    if byte_level:
        save_byte_level_tokenizer(folder)
    else:
        save_word_tokenizer(folder, config.vocab_size)
    return folder


LLAVA_IMAGE_TOKEN_ID = 95


def build_vllm_llava_checkpoint(folder: Path, seed: int = 0) -> Any:
    """A random-weight LLaVA (CLIP tower, projector, Llama with head_dim 64 for vLLM's
    CPU attention) with its processor (PIL image processor: resize the shortest edge to
    40, crop 32x32) and a word tokenizer holding ``<image>``, saved in the layout of the
    published ``llava-hf`` checkpoints (``vision_tower.vision_model.*``, which vLLM
    reads; transformers 5 writes ``vision_tower.*``). Returns the in-memory
    ``LlavaForConditionalGeneration`` and processor, the oracle."""
    from safetensors.torch import load_file, save_file

    from tests.unit.engine.conftest import WORDS, _scramble, save_random_llava

    vocab = LLAVA_IMAGE_TOKEN_ID + 1
    words = ["<unk>", "<s>", "</s>", *WORDS]
    words += [f"w{i}" for i in range(vocab - 1 - len(words))] + ["<image>"]
    vision = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    model, processor = save_random_llava(
        folder, vllm_llama_config(vocab), vision, words, 40, seed, init=_scramble
    )
    weights = folder / "model.safetensors"
    tensors = {
        f"vision_tower.vision_model.{k.removeprefix('vision_tower.')}"
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in load_file(str(weights)).items()
    }
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model, processor


def _engine_host() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class EngineHost:
        def __init__(
            self, backend: str, model: ModelConfig, engine: EngineConfig, lease: float | None
        ) -> None:
            from services.backends import make_engine

            self.engine = make_engine(backend, model, engine, kv_lease_s=lease)

        def call(self, method: str, *args: Any) -> Any:
            return getattr(self.engine, method)(*args)

        def get(self, attribute: str) -> Any:
            return getattr(self.engine, attribute, None)

    return EngineHost


class RemoteEngine:
    """An Engine in a Ray actor; every call blocks until it returns."""

    def __init__(
        self,
        backend: str,
        model: ModelConfig,
        engine: EngineConfig,
        *,
        kv_lease_s: float | None = None,
    ) -> None:
        import ray

        self._ray = ray
        self._actor = _engine_host().remote(backend, model, engine, kv_lease_s)
        self.moves_own_kv = bool(ray.get(self._actor.get.remote("moves_own_kv")))

    def _call(self, method: str, *args: Any) -> Any:
        return self._ray.get(self._actor.call.remote(method, *args), timeout=120)

    @property
    def model_info(self) -> Any:
        return self._ray.get(self._actor.get.remote("model_info"))

    @property
    def kv_layout(self) -> Any:
        return self._ray.get(self._actor.get.remote("kv_layout"))

    @property
    def kv_storage(self) -> Any:
        return None  # a remote engine's KV stays in its process

    def add_request(self, request: Any) -> None:
        self._call("add_request", request)

    def step(self) -> Any:
        return self._call("step")

    def abort(self, request_id: str) -> None:
        self._call("abort", request_id)

    def has_unfinished(self) -> bool:
        return bool(self._call("has_unfinished"))

    def stats(self) -> Any:
        return self._call("stats")

    def holds_blocks(self) -> bool:
        return bool(self._call("holds_blocks"))

    def release_held(self, request_id: str) -> None:
        self._call("release_held", request_id)

    def adopt(self, request: Any) -> list[int]:
        return list(self._call("adopt", request))

    def start_adopted(self, request_id: str) -> None:
        self._call("start_adopted", request_id)

    def encode(self, text: str) -> list[int]:
        return list(self._call("encode", text))

    def decode(self, token_ids: Any) -> str:
        return str(self._call("decode", list(token_ids)))

    def close(self) -> None:
        self._ray.kill(self._actor)
