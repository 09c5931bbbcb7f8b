"""Load a model by name: ``tiny`` (built in) or a local Hugging Face folder.

A folder must hold ``config.json`` naming a supported architecture, the weights
as ``*.safetensors`` (one file, or shards listed by ``model.safetensors.index.json``)
and a tokenizer. Nothing is downloaded. Errors are typed: ``ModelLoadError`` for a
folder we cannot read, ``UnsupportedModelError`` for an architecture we do not run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.engine.config import ModelArgs
from services.engine.messages import ModelLoadError
from services.engine.model import CausalLM, fuse_checkpoint
from services.engine.tiny import TINY_ARGS, TINY_NAME, build_tiny_model
from services.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["LoadedModel", "load_causal_lm", "load_model", "load_tokenizer", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# Checkpoint entries that are derived, not learned (old Llama exports carry them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: CausalLM
    args: ModelArgs
    tokenizer: Tokenizer
    name: str
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(requested: str, checkpoint_dtype: str) -> torch.dtype:
    """``auto`` means the checkpoint's own dtype; otherwise a name such as ``bfloat16``."""
    name = checkpoint_dtype if requested == "auto" else requested
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ModelLoadError(
            f"unsupported dtype {name!r}; expected auto or one of {sorted(_DTYPES)}"
        )
    return dtype


def load_model(
    name_or_path: str, *, dtype: str = "auto", device: str = "cpu", seed: int = 0
) -> LoadedModel:
    """``seed`` only matters for ``tiny`` (its random weights)."""
    torch_device = torch.device(device)
    if name_or_path == TINY_NAME:
        torch_dtype = resolve_dtype(dtype, TINY_ARGS.torch_dtype)
        return LoadedModel(
            model=build_tiny_model(seed, torch_dtype, torch_device),
            args=TINY_ARGS,
            tokenizer=ByteTokenizer(),
            name=TINY_NAME,
            dtype=torch_dtype,
            device=torch_device,
        )
    model = load_causal_lm(name_or_path, dtype=dtype, device=device)
    tokenizer = HFTokenizer(_model_folder(name_or_path), model.args.eos_token_ids)
    args = dataclasses.replace(model.args, eos_token_ids=tokenizer.eos_token_ids)
    model.args = args
    dtype_ = model.model.embed_tokens.weight.dtype
    return LoadedModel(model, args, tokenizer, name_or_path, dtype_, torch_device)


def load_causal_lm(name_or_path: str, *, dtype: str = "auto", device: str = "cpu") -> CausalLM:
    """The model alone, without a tokenizer (a folder needs config.json and safetensors)."""
    folder = _model_folder(name_or_path)
    args = _read_args(folder)
    torch_dtype = resolve_dtype(dtype, args.torch_dtype)
    return _build(args, _weight_files(folder), torch_dtype, torch.device(device))


def load_tokenizer(name_or_path: str) -> Tokenizer:
    if name_or_path == TINY_NAME:
        return ByteTokenizer()
    folder = _model_folder(name_or_path)
    return HFTokenizer(folder, extra_eos_token_ids=_read_args(folder).eos_token_ids)


def _model_folder(name_or_path: str) -> Path:
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a local folder nor a built-in model "
            f"({TINY_NAME!r}); models are never downloaded"
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model folder {folder}")
    return folder


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _read_args(folder: Path) -> ModelArgs:
    cfg = _read_json(folder / "config.json")
    generation = folder / "generation_config.json"
    if generation.is_file():
        # generation_config often lists more stop ids (e.g. Llama 3's <|eot_id|>).
        extra = _read_json(generation).get("eos_token_id")
        if extra is not None:
            base = cfg.get("eos_token_id")
            ids = [*([] if base is None else [base] if isinstance(base, int) else base)]
            ids += [extra] if isinstance(extra, int) else list(extra)
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys(ids))}
    return ModelArgs.from_hf_config(cfg)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {missing}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt")
        )
        hint = f" (found {others}; only safetensors are read)" if others else ""
        raise ModelLoadError(f"no *.safetensors weights in model folder {folder}{hint}")
    return files


def _build(
    args: ModelArgs, weight_files: list[Path], dtype: torch.dtype, device: torch.device
) -> CausalLM:
    # Built on the meta device: no time or memory is spent on a random init we overwrite.
    with torch.device("meta"):
        model = CausalLM(args)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if not key.endswith(_IGNORED_SUFFIXES):
                        state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {e}") from e
    try:
        state = fuse_checkpoint(state)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint does not match {args.architecture}: missing {e}") from e
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [
        k for k in result.missing_keys if not (args.tie_word_embeddings and k == "lm_head.weight")
    ]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"checkpoint does not match {args.architecture}: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )
    model.tie_weights()
    return model.eval()
