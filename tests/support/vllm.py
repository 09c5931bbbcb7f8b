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


def build_vllm_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A random-weight Llama that vLLM's CPU attention runs (head_dim 64), with a
    word-level tokenizer and chat template, saved by ``transformers``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.unit.engine.conftest import _scramble, save_word_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
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
    model = AutoModelForCausalLM.from_config(config)
    _scramble(model, seed)
    model.float().save_pretrained(str(folder))
    save_word_tokenizer(folder, config.vocab_size)
    return folder


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
