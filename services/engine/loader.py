"""Load a model by name: ``tiny``, ``tiny-vl`` (built in) or a local Hugging Face folder.

A folder must hold ``config.json`` naming a supported architecture (a
``LlavaForConditionalGeneration`` also needs its ``preprocessor_config.json``), the weights
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
from services.engine.image_processing import ImageProcessor
from services.engine.llava import (
    LLAVA_ARCHITECTURE,
    ImageEncoder,
    LlavaArgs,
    LoadedVision,
    split_llava_checkpoint,
)
from services.engine.messages import ModelLoadError
from services.engine.model import CausalLM, fuse_checkpoint
from services.engine.tiny import TINY_ARGS, TINY_NAME, build_tiny_model
from services.engine.tiny_vl import TINY_VL_NAME, build_tiny_vl, build_tiny_vl_tokenizer
from services.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "BUILT_IN_MODELS",
    "LoadedModel",
    "check_model_source",
    "load_causal_lm",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
]

BUILT_IN_MODELS = (TINY_NAME, TINY_VL_NAME)  # served with no files; anything else is a folder

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
    vision: LoadedVision | None = None  # a multimodal model's image encoder and processor


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
    if name_or_path == TINY_VL_NAME:
        torch_dtype = resolve_dtype(dtype, TINY_ARGS.torch_dtype)
        lm, tiny_vision, byte_tokenizer = build_tiny_vl(seed, torch_dtype, torch_device)
        return LoadedModel(
            lm, lm.args, byte_tokenizer, TINY_VL_NAME, torch_dtype, torch_device, tiny_vision
        )
    folder = _model_folder(name_or_path)
    model, vision = _load_folder(folder, dtype, torch_device)
    tokenizer = HFTokenizer(folder, model.args.eos_token_ids)
    args = dataclasses.replace(model.args, eos_token_ids=tokenizer.eos_token_ids)
    model.args = args
    dtype_ = model.model.embed_tokens.weight.dtype
    return LoadedModel(model, args, tokenizer, name_or_path, dtype_, torch_device, vision)


def load_causal_lm(name_or_path: str, *, dtype: str = "auto", device: str = "cpu") -> CausalLM:
    """The (language) model alone, without a tokenizer (a folder needs config.json and safetensors)."""
    return _load_folder(_model_folder(name_or_path), dtype, torch.device(device))[0]


def load_tokenizer(name_or_path: str) -> Tokenizer:
    if name_or_path == TINY_NAME:
        return ByteTokenizer()
    if name_or_path == TINY_VL_NAME:
        return build_tiny_vl_tokenizer()
    folder = _model_folder(name_or_path)
    return HFTokenizer(folder, extra_eos_token_ids=_read_args(folder).eos_token_ids)


def check_model_source(name_or_path: str) -> None:
    """Raise ``ModelLoadError`` unless ``name_or_path`` is a built-in model or a folder
    with a config.json: what ``baton serve`` checks before it starts anything."""
    if name_or_path not in BUILT_IN_MODELS:
        _model_folder(name_or_path)


def _model_folder(name_or_path: str) -> Path:
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"model {name_or_path!r} is neither a local folder nor a built-in model "
            f"({', '.join(map(repr, BUILT_IN_MODELS))}); models are never downloaded"
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


def _load_folder(
    folder: Path, dtype: str, device: torch.device
) -> tuple[CausalLM, LoadedVision | None]:
    cfg = _read_config(folder)
    if not _is_llava(cfg):
        args = ModelArgs.from_hf_config(cfg)
        torch_dtype = resolve_dtype(dtype, args.torch_dtype)
        return _build(args, _read_state(_weight_files(folder), torch_dtype, device)), None
    largs = _llava_args(cfg)
    processor = _image_processor(folder)
    if processor.output_hw() != (largs.vision.image_size, largs.vision.image_size):
        raise ModelLoadError(
            f"the image processor of {folder} makes {processor.output_hw()} images; the "
            f"vision tower takes {largs.vision.image_size}x{largs.vision.image_size}"
        )
    torch_dtype = resolve_dtype(dtype, largs.text.torch_dtype)
    text_state, vision_state = split_llava_checkpoint(
        _read_state(_weight_files(folder), torch_dtype, device)
    )
    model = _build(largs.text, text_state)
    encoder = _build_image_encoder(largs, vision_state)
    return model, LoadedVision(encoder, processor, largs.image_token_id, largs.num_image_tokens)


def _image_processor(folder: Path) -> ImageProcessor:
    # transformers 4 saves preprocessor_config.json; 5 nests it in processor_config.json.
    if (folder / "preprocessor_config.json").is_file():
        return ImageProcessor.from_hf_config(_read_json(folder / "preprocessor_config.json"))
    if (folder / "processor_config.json").is_file():
        nested = _read_json(folder / "processor_config.json").get("image_processor")
        if isinstance(nested, dict):
            return ImageProcessor.from_hf_config(nested)
    raise ModelLoadError(
        f"no image processor config (preprocessor_config.json, or processor_config.json's "
        f"image_processor) in {LLAVA_ARCHITECTURE} folder {folder}"
    )


def _is_llava(cfg: dict[str, Any]) -> bool:
    return LLAVA_ARCHITECTURE in (cfg.get("architectures") or [])


def _llava_args(cfg: dict[str, Any]) -> LlavaArgs:
    # Released LLaVA configs list only what differs from the sub-models' defaults;
    # transformers' config classes fill in the rest (no download: a dict in, a dict out).
    from transformers import LlavaConfig

    try:
        full = LlavaConfig.from_dict(cfg).to_dict()
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the {LLAVA_ARCHITECTURE} config: {e}") from e
    if cfg.get("eos_token_id") is not None:  # from generation_config.json
        text = full["text_config"]
        text["eos_token_id"] = _merge_ids(text.get("eos_token_id"), cfg["eos_token_id"])
    return LlavaArgs.from_hf_config(full)


def _read_args(folder: Path) -> ModelArgs:
    cfg = _read_config(folder)
    return _llava_args(cfg).text if _is_llava(cfg) else ModelArgs.from_hf_config(cfg)


def _read_config(folder: Path) -> dict[str, Any]:
    cfg = _read_json(folder / "config.json")
    generation = folder / "generation_config.json"
    if generation.is_file():
        # generation_config often lists more stop ids (e.g. Llama 3's <|eot_id|>).
        extra = _read_json(generation).get("eos_token_id")
        if extra is not None:
            cfg = {**cfg, "eos_token_id": _merge_ids(cfg.get("eos_token_id"), extra)}
    return cfg


def _merge_ids(base: int | list[int] | None, extra: int | list[int] | None) -> list[int]:
    ids = [*([] if base is None else [base] if isinstance(base, int) else base)]
    ids += [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys(ids))


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


def _read_state(
    weight_files: list[Path], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if not key.endswith(_IGNORED_SUFFIXES):
                        state[key] = f.get_tensor(key).to(device=device, dtype=dtype)
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {e}") from e
    return state


def _build(args: ModelArgs, state: dict[str, torch.Tensor]) -> CausalLM:
    # Built on the meta device: no time or memory is spent on a random init we overwrite.
    with torch.device("meta"):
        model = CausalLM(args)
    try:
        state = fuse_checkpoint(state)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint does not match {args.architecture}: missing {e}") from e
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    _assign(model, state, args.architecture, tied)
    model.tie_weights()
    return model.eval()


def _build_image_encoder(args: LlavaArgs, state: dict[str, torch.Tensor]) -> ImageEncoder:
    with torch.device("meta"):
        encoder = ImageEncoder(args)
    _assign(encoder, state, LLAVA_ARCHITECTURE, set())
    return encoder.eval()


def _assign(
    module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, may_miss: set[str]
) -> None:
    result = module.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k not in may_miss]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"checkpoint does not match {what}: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )
