"""Helpers for the multimodal engine tests: random images, and tiny-vl's transformers twin."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from services.engine.loader import LoadedModel
from services.engine.messages import ImageInput
from services.engine.placeholders import image_offsets
from services.engine.tiny_vl import tiny_vl_hf_config


def random_image(seed: int, width: int, height: int, mode: str = "RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def hf_names(loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Our weights under the names of transformers 5's in-memory LlavaForConditionalGeneration."""
    assert loaded.vision is not None
    text = {
        k if k.startswith("lm_head.") else f"model.language_model.{k.removeprefix('model.')}": v
        for k, v in loaded.model.hf_state_dict().items()
    }
    return text | {f"model.{k}": v for k, v in loaded.vision.encoder.state_dict().items()}


def tiny_vl_twin(loaded: LoadedModel) -> Any:
    """transformers' LlavaForConditionalGeneration holding tiny-vl's weights (float32, eval)."""
    from transformers import LlavaForConditionalGeneration

    twin = LlavaForConditionalGeneration(tiny_vl_hf_config()).float().eval()
    twin.load_state_dict(hf_names(loaded), strict=True)
    return twin


def image_inputs(
    prompt: list[int], images: list[Image.Image], image_token_id: int, per_image: int
) -> tuple[ImageInput, ...]:
    """ImageInputs (PNG data) for the placeholder runs of an expanded prompt, in order."""
    offsets = image_offsets(prompt, image_token_id, per_image)
    assert len(offsets) == len(images)
    out = []
    for offset, image in zip(offsets, images):
        data = png_bytes(image)
        out.append(ImageInput(hashlib.sha256(data).hexdigest(), offset, per_image, data=data))
    return tuple(out)
