"""What Baton's config becomes inside vLLM: the engine settings the two engines share
reach vLLM's own scheduler (read back from the config vLLM builds from them, not from
our argument dict), and ``engine.vllm`` overrides them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.backends.vllm.start import vllm_engine_args
from services.config import EngineConfig, ModelConfig
from tests.support.vllm import build_vllm_checkpoint

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_checkpoint(tmp_path_factory.mktemp("vllm-args"))


def _vllm_config(checkpoint: Path, **engine: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = vllm_engine_args(
        ModelConfig(name=str(checkpoint), dtype="float32", seed=7),
        EngineConfig(device="cpu", **engine),
        on_cpu=True,
        takes_embeddings=False,
    )
    return EngineArgs(**args).create_engine_config()


def test_the_shared_engine_settings_reach_vllms_scheduler(checkpoint: Path) -> None:
    config = _vllm_config(
        checkpoint,
        long_prefill_token_threshold=16,
        max_num_seqs=6,
        max_num_batched_tokens=96,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    scheduler = config.scheduler_config
    assert scheduler.long_prefill_token_threshold == 16
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (6, 96)
    assert config.model_config.max_model_len == 96
    assert config.model_config.seed == 7
    assert not config.cache_config.enable_prefix_caching


def test_engine_vllm_options_override_the_shared_settings(checkpoint: Path) -> None:
    config = _vllm_config(
        checkpoint, long_prefill_token_threshold=16, vllm={"long_prefill_token_threshold": 24}
    )
    assert config.scheduler_config.long_prefill_token_threshold == 24


def test_json_is_compact_unless_engine_vllm_says(checkpoint: Path) -> None:
    """vLLM reads free whitespace per engine (a request's own setting is ignored): off,
    as the embedded engine's default; ``engine.vllm`` may change each key alone."""
    config = _vllm_config(checkpoint).structured_outputs_config
    assert config.disable_any_whitespace and config.backend == "xgrammar"
    guidance = {"structured_outputs_config": {"backend": "guidance"}}
    config = _vllm_config(checkpoint, vllm=guidance).structured_outputs_config
    assert config.disable_any_whitespace and config.backend == "guidance"
    loose = {"structured_outputs_config": {"disable_any_whitespace": False}}
    config = _vllm_config(checkpoint, vllm=loose).structured_outputs_config
    assert not config.disable_any_whitespace and config.backend == "xgrammar"
