"""Image placeholder tokens in a prompt: expand them, find each image's run. Torch-free.

LLaVA's processor replaces each ``<image>`` with ``num_image_tokens`` copies of it;
image ``k`` then owns the ``k``-th run of that length (adjacent images make one long
run, split in order).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_VL_IMAGE_PROMPT",
    "ImagePromptSpec",
    "expand_image_tokens",
    "image_offsets",
    "read_image_prompt_spec",
]


@dataclass(frozen=True, slots=True)
class ImagePromptSpec:
    """How a multimodal model's images enter its prompt."""

    image_token_id: int
    num_image_tokens: int  # placeholders per image


# tiny-vl's (services/engine/tiny_vl.py; a test holds the two equal): here without torch.
TINY_VL_IMAGE_PROMPT = ImagePromptSpec(image_token_id=261, num_image_tokens=16)


def read_image_prompt_spec(name_or_path: str) -> ImagePromptSpec | None:
    """The model's image prompt spec from its config alone (no weights, no torch); None: text only."""
    if name_or_path == "tiny-vl":
        return TINY_VL_IMAGE_PROMPT
    path = Path(name_or_path).expanduser() / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    if "LlavaForConditionalGeneration" not in (cfg.get("architectures") or []):
        return None
    from transformers import LlavaConfig  # fills the vision defaults released configs omit

    full = LlavaConfig.from_dict(cfg)
    vision: Any = full.vision_config
    side = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
    patch = vision.patch_size if isinstance(vision.patch_size, int) else vision.patch_size[0]
    drop_cls = full.vision_feature_select_strategy == "default"
    return ImagePromptSpec(
        image_token_id=int(full.image_token_id),
        num_image_tokens=(side // patch) ** 2 + (0 if drop_cls else 1),
    )


def expand_image_tokens(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: int
) -> list[int]:
    """Each placeholder becomes ``num_image_tokens`` of them, as LLaVA's processor expands ``<image>``."""
    out: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            out.extend([t] * num_image_tokens)
        else:
            out.append(t)
    return out


def image_offsets(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: int
) -> list[int]:
    """The prompt position of each image's first placeholder (an expanded prompt), in order."""
    offsets: list[int] = []
    run = 0
    for i, t in enumerate(token_ids):
        run = run + 1 if t == image_token_id else 0
        if run and (run - 1) % num_image_tokens == 0:
            offsets.append(i)
    return offsets
