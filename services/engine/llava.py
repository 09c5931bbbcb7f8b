"""LLaVA: a CLIP-style vision tower, a two-layer projector, and a Llama/Qwen2 language model.

The language model is the engine's ordinary ``CausalLM``; the vision half is an
``ImageEncoder`` beside it (``LoadedModel.vision``), so an encode worker can run it
alone and hand the embeddings to a prefill worker. An image becomes
``num_image_tokens`` embeddings that replace, in order, the prompt's runs of
``image_token_id`` placeholders (see ``placeholders.py``).

Checkpoints are read in every layout ``transformers`` has saved: ``language_model.model.*``
/ ``language_model.lm_head.*`` / ``vision_tower[.vision_model].*`` /
``multi_modal_projector.*`` (4.x and 5.x saves), and ``model.language_model.*`` /
``model.vision_tower.*`` / ``model.multi_modal_projector.*`` / ``lm_head.*`` (4.5x).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.engine.config import ModelArgs
from services.engine.image_processing import ImageProcessor
from services.engine.messages import UnsupportedModelError
from services.engine.vision import VisionArgs, VisionTower, activation

__all__ = [
    "LLAVA_ARCHITECTURE",
    "ImageEncoder",
    "LlavaArgs",
    "LoadedVision",
    "split_llava_checkpoint",
]

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"
_TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class LlavaArgs:
    text: ModelArgs
    vision: VisionArgs
    image_token_id: int
    feature_layers: tuple[int, ...]  # the tower's hidden states read (HF indexing), concatenated
    drop_cls: bool  # select strategy "default": the class token is not an image token
    projector_act: str
    projector_bias: bool

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and embeddings) per image."""
        return self.vision.num_patches + (0 if self.drop_cls else 1)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlavaArgs:
        """Read a ``LlavaForConditionalGeneration`` config.json (sub-configs with defaults filled)."""
        text_cfg = dict(cfg["text_config"])
        model_type = str(text_cfg.get("model_type", "llama"))
        text_arch = _TEXT_ARCHITECTURES.get(model_type)
        if text_arch is None:
            raise UnsupportedModelError(
                f"{LLAVA_ARCHITECTURE}: language model {model_type!r} is not supported; "
                f"supported: {', '.join(_TEXT_ARCHITECTURES)}"
            )
        text_cfg["architectures"] = [text_arch]
        # The checkpoint's dtype is the top-level one; a sub-config's may be stale or absent.
        text_cfg["torch_dtype"] = (
            cfg.get("torch_dtype")
            or cfg.get("dtype")
            or text_cfg.get("torch_dtype")
            or text_cfg.get("dtype")
            or "float32"
        )
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedModelError(
                f"{LLAVA_ARCHITECTURE}: vision_feature_select_strategy {strategy!r}"
            )
        layer = cfg.get("vision_feature_layer", -2)
        layers = (int(layer),) if isinstance(layer, int) else tuple(int(x) for x in layer)
        act = str(cfg.get("projector_hidden_act", "gelu"))
        activation(act)
        token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
        if token_id is None:
            raise UnsupportedModelError(f"{LLAVA_ARCHITECTURE}: config names no image_token_id")
        return cls(
            text=ModelArgs.from_hf_config(text_cfg),
            vision=VisionArgs.from_hf_config(dict(cfg["vision_config"])),
            image_token_id=int(token_id),
            feature_layers=layers,
            drop_cls=strategy == "default",
            projector_act=act,
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        )


class Projector(nn.Module):
    def __init__(self, args: LlavaArgs) -> None:
        super().__init__()
        in_dim = args.vision.hidden_size * len(args.feature_layers)
        out_dim = args.text.hidden_size
        self.act = activation(args.projector_act)
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=args.projector_bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=args.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEncoder(nn.Module):
    """Pixels ``[N, 3, S, S]`` -> image embeddings ``[N, num_image_tokens, text hidden]``."""

    def __init__(self, args: LlavaArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = VisionTower(args.vision)
        self.multi_modal_projector = Projector(args)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.multi_modal_projector.linear_1.weight
        states = self.vision_tower(pixel_values.to(weight.device), self.args.feature_layers)
        if self.args.drop_cls:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))


@dataclass
class LoadedVision:
    """The vision half of a loaded multimodal model, and how its images enter a prompt."""

    encoder: ImageEncoder
    processor: ImageProcessor
    image_token_id: int
    num_image_tokens: int  # placeholders per image

    def encode(self, images: Sequence[Any]) -> torch.Tensor:
        """PIL images -> ``[N, num_image_tokens, hidden]`` in the model's dtype."""
        return self.encoder(self.processor.preprocess(images))


_LM = re.compile(r"^(?:language_model\.|model\.language_model\.)(?:model\.)?(.*)$")
_LM_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.(.*)$")
_VISION = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_PROJECTOR = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")


def split_llava_checkpoint(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LLaVA state dict -> (CausalLM names, ImageEncoder names); UnsupportedModelError on strays."""
    text: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if m := _LM_HEAD.match(key):
            text[f"lm_head.{m.group(1)}"] = tensor
        elif m := _LM.match(key):
            text[f"model.{m.group(1)}"] = tensor
        elif m := _VISION.match(key):
            vision[f"vision_tower.{m.group(1)}"] = tensor
        elif m := _PROJECTOR.match(key):
            vision[f"multi_modal_projector.{m.group(1)}"] = tensor
        else:
            raise UnsupportedModelError(f"{LLAVA_ARCHITECTURE}: unexpected tensor {key!r}")
    return text, vision
