"""The built-in ``tiny-vl`` model: ``tiny``'s multimodal sibling, a tiny LLaVA with no files.

The language model is ``tiny``'s shape with one more token, ``<|image|>`` (the image
placeholder); the vision tower takes 32x32 images in 8x8 patches, so an image is 16
placeholder tokens. Weights are seeded random, like ``tiny``'s: the output is
meaningless but deterministic, and ``tiny_vl_hf_config`` builds its ``transformers``
twin for parity tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from services.engine.image_processing import ImageProcessor
from services.engine.llava import ImageEncoder, LlavaArgs, LoadedVision
from services.engine.model import CausalLM
from services.engine.tiny import TINY_ARGS, build_tiny_model, init_random, tiny_hf_config
from services.engine.tokenizer import ByteTokenizer
from services.engine.vision import VisionArgs

__all__ = [
    "TINY_VL_ARGS",
    "TINY_VL_NAME",
    "TINY_VL_PROCESSOR",
    "ByteVisionTokenizer",
    "build_tiny_vl",
    "build_tiny_vl_tokenizer",
    "tiny_vl_hf_config",
]

TINY_VL_NAME = "tiny-vl"


class ByteVisionTokenizer(ByteTokenizer):
    """The byte tokenizer plus ``<|image|>``, which image content parts render as."""

    SPECIALS = (*ByteTokenizer.SPECIALS, "<|image|>")
    IMAGE = 256 + len(ByteTokenizer.SPECIALS)
    IMAGE_PLACEHOLDER = "<|image|>"


def build_tiny_vl_tokenizer() -> ByteVisionTokenizer:
    return ByteVisionTokenizer()


TINY_VL_ARGS = LlavaArgs(
    text=dataclasses.replace(TINY_ARGS, vocab_size=ByteVisionTokenizer().vocab_size),
    vision=VisionArgs(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_channels=3,
        image_size=32,
        patch_size=8,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    ),
    image_token_id=ByteVisionTokenizer.IMAGE,
    feature_layers=(-2,),
    drop_cls=True,
    projector_act="gelu",
    projector_bias=True,
)

TINY_VL_PROCESSOR = ImageProcessor(
    shortest_edge=32,
    resize_hw=None,
    crop_hw=(32, 32),
    rescale_factor=1 / 255,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)


def build_tiny_vl(
    seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[CausalLM, LoadedVision, ByteVisionTokenizer]:
    """The language model (seed ``seed``), the vision half (seed ``seed + 1``) and the tokenizer."""
    model = build_tiny_model(seed, dtype, device, TINY_VL_ARGS.text)
    encoder = ImageEncoder(TINY_VL_ARGS)
    init_random(encoder, seed + 1)
    encoder = encoder.to(device=device, dtype=dtype).eval()
    vision = LoadedVision(
        encoder, TINY_VL_PROCESSOR, TINY_VL_ARGS.image_token_id, TINY_VL_ARGS.num_image_tokens
    )
    return model, vision, build_tiny_vl_tokenizer()


def tiny_vl_hf_config() -> Any:
    """The ``transformers`` LlavaConfig of ``tiny-vl`` (its twin in tests)."""
    from transformers import CLIPVisionConfig, LlavaConfig

    text = tiny_hf_config()
    text.vocab_size = TINY_VL_ARGS.text.vocab_size
    v = TINY_VL_ARGS.vision
    vision = CLIPVisionConfig(
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_hidden_layers=v.num_layers,
        num_attention_heads=v.num_heads,
        num_channels=v.num_channels,
        image_size=v.image_size,
        patch_size=v.patch_size,
        hidden_act=v.hidden_act,
        layer_norm_eps=v.layer_norm_eps,
    )
    return LlavaConfig(  # type: ignore[call-arg]  # 5.x takes image_token_id
        text_config=text,
        vision_config=vision,
        image_token_id=TINY_VL_ARGS.image_token_id,
        vision_feature_layer=TINY_VL_ARGS.feature_layers[0],
        vision_feature_select_strategy="default",
        projector_hidden_act=TINY_VL_ARGS.projector_act,
        multimodal_projector_bias=TINY_VL_ARGS.projector_bias,
        tie_word_embeddings=TINY_VL_ARGS.text.tie_word_embeddings,
    )
