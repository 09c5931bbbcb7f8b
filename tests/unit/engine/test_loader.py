"""Loading: the built-in tiny model, HF folders, typed errors and dtype selection."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.config import ModelArgs
from services.engine.loader import load_model, load_tokenizer
from services.engine.messages import ModelLoadError, UnsupportedModelError
from tests.unit.engine.conftest import HFCheckpoint


def _copy(ckpt: HFCheckpoint, dst: Path) -> Path:
    shutil.copytree(ckpt.folder, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_tiny_weights_are_deterministic_in_the_seed() -> None:
    a, b, c = load_model("tiny", seed=7), load_model("tiny", seed=7), load_model("tiny", seed=8)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    q = "model.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(sa[q], sc[q])
    assert a.model.lm_head.weight is a.model.model.embed_tokens.weight  # tied
    assert a.args.vocab_size == a.tokenizer.vocab_size
    assert a.args.num_kv_heads < a.args.num_heads  # grouped-query attention
    assert set(a.args.eos_token_ids) == set(a.tokenizer.eos_token_ids)


def test_tiny_dtype_override() -> None:
    loaded = load_model("tiny", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert load_model("tiny").dtype == torch.float32  # auto = the config's dtype


def test_unsupported_architecture_is_named(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("llama"), tmp_path / "m")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(folder))
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)


def test_folder_without_weights(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("llama"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(str(folder))


def test_sharded_folder_with_a_missing_shard(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("llama_sharded"), tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=re.escape(shard.name)):
        load_model(str(folder))


def test_checkpoint_missing_a_tensor(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("llama"), tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder))


def test_missing_config_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="neither a local folder"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path / "nope"))


def test_dtype_auto_follows_the_checkpoint_and_can_be_overridden(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("qwen2"), tmp_path / "m")
    assert load_model(str(folder)).dtype == torch.float32
    _edit_config(folder, dtype="bfloat16")
    loaded = load_model(str(folder))
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert load_model(str(folder), dtype="float32").dtype == torch.float32
    with pytest.raises(ModelLoadError, match="int3"):
        load_model(str(folder), dtype="int3")


def test_tied_checkpoint_ties_lm_head(hf_checkpoint: Callable[[str], HFCheckpoint]) -> None:
    loaded = load_model(str(hf_checkpoint("qwen2").folder))
    assert loaded.args.tie_word_embeddings and loaded.args.qkv_bias
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_generation_config_eos_ids_are_merged(
    hf_checkpoint: Callable[[str], HFCheckpoint], tmp_path: Path
) -> None:
    folder = _copy(hf_checkpoint("llama"), tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(str(folder))
    assert set(loaded.args.eos_token_ids) == {2, 7}
    assert set(loaded.tokenizer.eos_token_ids) == {2, 7}


def test_tokenizer_and_chat_template_come_from_the_folder(
    hf_checkpoint: Callable[[str], HFCheckpoint],
) -> None:
    tok = load_tokenizer(str(hf_checkpoint("llama").folder))
    text = tok.apply_chat_template([{"role": "user", "content": "hello world"}])
    assert text == "<|user|> hello world </s> <|assistant|> "
    ids = tok.encode("the cat sat", add_special_tokens=False)
    assert ids == [5, 7, 8]
    assert tok.decode(ids) == "the cat sat"
    assert tok.eos_token_ids == (2,)


def test_transformers4_style_rope_config() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
        "eos_token_id": [1, 2],
    }
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == 500000.0
    assert args.rope_scaling is not None and args.rope_scaling["rope_type"] == "llama3"
    assert (args.head_dim, args.torch_dtype, args.eos_token_ids) == (8, "bfloat16", (1, 2))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelArgs.from_hf_config({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_hf_state_dict_round_trips_the_checkpoint(
    hf_checkpoint: Callable[[str], HFCheckpoint],
) -> None:
    ckpt = hf_checkpoint("qwen2")  # biases on q/k/v, tied embeddings
    ours = load_model(str(ckpt.folder)).model.hf_state_dict()
    theirs = ckpt.model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_tiny_weights_load_into_a_transformers_llama() -> None:
    """The tiny model has a transformers twin (benchmarks compare against it)."""
    from transformers import LlamaForCausalLM

    from services.engine.tiny import tiny_hf_config

    loaded = load_model("tiny")
    twin = LlamaForCausalLM(tiny_hf_config()).eval()
    twin.load_state_dict(loaded.model.hf_state_dict(), strict=True)
    ids = loaded.tokenizer.encode("hello tiny")
    with torch.no_grad():
        ref = twin(torch.tensor([ids])).logits[0]
    from tests.unit.engine.test_model_parity import PagedRunner

    (got,) = PagedRunner(loaded.model).step([("a", ids)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
