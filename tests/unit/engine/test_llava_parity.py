"""LLaVA in the embedded engine must reproduce transformers' LlavaForConditionalGeneration.

The oracle is a tiny random checkpoint saved by ``transformers`` with its processor
(image processor config, tokenizer with ``<image>``, processor config): our image
preprocessing, placeholder expansion and logits must equal Hugging Face's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from services.engine.batch import ForwardBatch
from services.engine.llava import LoadedVision, split_llava_checkpoint
from services.engine.loader import load_model
from services.engine.messages import UnsupportedModelError
from services.engine.model import CausalLM
from services.engine.placeholders import (
    ImagePromptSpec,
    expand_image_tokens,
    read_image_prompt_spec,
)
from services.engine.tiny_vl import TINY_VL_NAME
from tests.unit.engine.conftest import _scramble, save_random_llava
from tests.unit.engine.llava_twin import hf_names, random_image, tiny_vl_twin

TOL = 1e-4
VOCAB = 96
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = VOCAB - 1


WORDS = ["<unk>", "<s>", "</s>", "hello", "the", "cat", "sat", "on", "a", "mat", "USER:"]
WORDS += [f"w{i}" for i in range(VOCAB - 1 - len(WORDS))] + [IMAGE_TOKEN]


@dataclass
class LlavaCheckpoint:
    folder: Path
    model: Any  # transformers LlavaForConditionalGeneration, float32, eval
    processor: Any  # transformers LlavaProcessor


def _build(folder: Path, feature_layer: int | list[int], strategy: str) -> LlavaCheckpoint:
    from transformers import LlamaConfig

    text = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=16,
    )
    # Resize the shortest edge to 40, then crop 32x32: both steps matter.
    model, processor = save_random_llava(
        folder,
        text,
        vision,
        WORDS,
        40,
        init=_scramble,
        feature_layer=feature_layer,
        strategy=strategy,
    )
    return LlavaCheckpoint(folder, model, processor)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> LlavaCheckpoint:
    return _build(tmp_path_factory.mktemp("llava"), -2, "default")


def _logits_ours(
    model: CausalLM, vision: LoadedVision, token_ids: list[int], images: list[Image.Image]
) -> torch.Tensor:
    """One whole prompt through the paged LM, images placed at their placeholders."""
    block_size, n = 4, len(token_ids)
    a = model.args
    num_blocks = -(-n // block_size)
    kv = torch.zeros(num_blocks, a.num_layers, 2, a.num_kv_heads, block_size, a.head_dim)
    ids = torch.tensor(token_ids)
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        query_lens=[n],
        context_lens=[n],
        block_tables=[list(range(num_blocks))],
    )
    embeds = model.embed(ids)
    if images:
        image_embeds = vision.encode(images)
        embeds[ids == vision.image_token_id] = image_embeds.reshape(-1, a.hidden_size)
    return model.compute_logits(model(batch, kv, embeds))


def _logits_hf(ckpt: LlavaCheckpoint, text: str, images: list[Image.Image]) -> Any:
    inputs = ckpt.processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = ckpt.model(**inputs)
    return inputs, out.logits[0].float()


@pytest.mark.parametrize(
    "images",
    [
        [random_image(1, 48, 40)],  # one image, landscape
        [
            random_image(2, 30, 56, "RGBA"),
            random_image(3, 64, 64),
        ],  # two: portrait (upscaled), square
    ],
    ids=["one_image", "two_images"],
)
def test_logits_equal_transformers(llava: LlavaCheckpoint, images: list[Image.Image]) -> None:
    loaded = load_model(str(llava.folder))
    assert loaded.vision is not None
    text = " ".join(["USER:", IMAGE_TOKEN, "hello the cat"] + [IMAGE_TOKEN] * (len(images) - 1))
    text += " sat on a mat"
    inputs, expected = _logits_hf(llava, text, images)

    token_ids = expand_image_tokens(
        loaded.tokenizer.encode(text), loaded.vision.image_token_id, loaded.vision.num_image_tokens
    )
    assert token_ids == inputs["input_ids"][0].tolist()  # placeholder expansion as the processor
    pixels = loaded.vision.processor.preprocess(images)
    torch.testing.assert_close(pixels, inputs["pixel_values"], atol=1e-6, rtol=0)
    got = _logits_ours(loaded.model, loaded.vision, token_ids, images)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    # A wrong image in the same slots would not pass: the images do steer the logits.
    other = _logits_ours(
        loaded.model, loaded.vision, token_ids, [random_image(9, 32, 32)] * len(images)
    )
    assert (other - expected).abs().max() > 100 * TOL


@pytest.mark.parametrize("name", ["checkpoint", TINY_VL_NAME])
def test_the_gateways_image_spec_agrees_with_the_loaded_model(
    llava: LlavaCheckpoint, name: str
) -> None:
    # The gateway reads it from config.json alone (no torch, no weights).
    path = str(llava.folder) if name == "checkpoint" else name
    loaded = load_model(path)
    assert loaded.vision is not None
    spec = ImagePromptSpec(loaded.vision.image_token_id, loaded.vision.num_image_tokens)
    assert read_image_prompt_spec(path) == spec
    assert read_image_prompt_spec("tiny") is None


def test_text_only_prompt_to_a_llava_model(llava: LlavaCheckpoint) -> None:
    loaded = load_model(str(llava.folder))
    assert loaded.vision is not None
    _, expected = _logits_hf(llava, "USER: hello the cat sat", [])
    ids = loaded.tokenizer.encode("USER: hello the cat sat")
    torch.testing.assert_close(
        _logits_ours(loaded.model, loaded.vision, ids, []), expected, atol=TOL, rtol=0
    )


@pytest.mark.parametrize(("layer", "strategy"), [([-3, -1], "full"), (0, "default")])
def test_feature_layers_and_full_strategy(
    tmp_path: Path, layer: int | list[int], strategy: str
) -> None:
    ckpt = _build(tmp_path, layer, strategy)
    loaded = load_model(str(tmp_path))
    assert loaded.vision is not None
    images = [random_image(4, 40, 36)]
    text = f"USER: {IMAGE_TOKEN} hello"
    inputs, expected = _logits_hf(ckpt, text, images)
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE_TOKEN_ID) == loaded.vision.num_image_tokens
    got = _logits_ours(loaded.model, loaded.vision, ids, images)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_tiny_vl_equals_its_transformers_twin() -> None:
    loaded = load_model(TINY_VL_NAME)
    assert loaded.vision is not None
    text_state, vision_state = split_llava_checkpoint(hf_names(loaded))  # 5.x names split too
    assert set(vision_state) == set(loaded.vision.encoder.state_dict())
    assert "lm_head.weight" in text_state
    twin = tiny_vl_twin(loaded)
    images = [random_image(5, 50, 40), random_image(6, 32, 32)]
    prompt = loaded.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            }
        ]
    )
    raw = loaded.tokenizer.encode(prompt)
    assert raw.count(loaded.vision.image_token_id) == 2
    ids = expand_image_tokens(raw, loaded.vision.image_token_id, loaded.vision.num_image_tokens)
    pixels = loaded.vision.processor.preprocess(images)
    with torch.no_grad():
        expected = twin(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    got = _logits_ours(loaded.model, loaded.vision, ids, images)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["Qwen2VLForConditionalGeneration"]}, "Qwen2VLForConditionalGeneration"),
        (
            {"architectures": ["LlavaNextForConditionalGeneration"]},
            "LlavaNextForConditionalGeneration",
        ),
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "siglip_vision_model"),
        ({"text_config": {"model_type": "gemma"}}, "gemma"),
    ],
)
def test_other_multimodal_models_are_refused_by_name(
    llava: LlavaCheckpoint, tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(llava.folder, folder)
    _edit_config(folder, **changes)
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(str(folder))
