"""Images through Baton over vLLM (its CPU build): vLLM's own LLaVA path, encoded on the
worker that prefills, as ``baton serve --backend vllm`` serves them to the ``openai``
client.

Six chat requests served together (one image, two, none; sizes that resize and crop;
an RGBA image), 32 greedy tokens each, must equal ``transformers``'
``LlavaForConditionalGeneration.generate`` on the same checkpoint: colocated (one
worker), and 1 prefill + 1 decode over vLLM's NixlConnector (the decoder pulls the
prompt's KV; its prefix-cache hashes cover the images it is sent)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from tests.support.serve_cli import baton_serve, serve_env
from tests.support.vllm import build_vllm_llava_checkpoint, vllm_serve_args
from tests.unit.engine.llava_twin import png_bytes, random_image

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.vllm]

NUM_NEW = 32
# (text, images as (seed, width, height, mode))
CASES: list[tuple[str, list[tuple[int, int, int, str]]]] = [
    ("the cat", [(1, 48, 40, "RGB")]),
    ("hello world", [(2, 30, 56, "RGBA"), (3, 64, 64, "RGB")]),
    ("the cat sat on a mat", []),
    ("a", [(4, 32, 32, "RGB")]),
    ("hello the mat", [(5, 100, 20, "RGB"), (6, 33, 47, "RGB")]),
    ("world", [(1, 48, 40, "RGB")]),  # case 0's image again, other words
]


def _images(specs: list[tuple[int, int, int, str]]) -> list[Any]:
    return [random_image(seed, w, h, mode) for seed, w, h, mode in specs]


def _parts(text: str, urls: list[str]) -> list[dict[str, Any]]:
    images = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [*images, {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The folder, and transformers' NUM_NEW greedy tokens per case as text."""
    folder = tmp_path_factory.mktemp("vllm-llava")
    model, processor = build_vllm_llava_checkpoint(folder)
    model.generation_config.eos_token_id = None  # exactly NUM_NEW tokens, as ignore_eos
    texts = []
    for text, specs in CASES:
        images = _images(specs)
        # The chat as the template takes it: image parts as {"type": "image"}.
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        chat = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        inputs = processor(text=chat, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=0)
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        assert len(new) == NUM_NEW
        texts.append(processor.tokenizer.decode(new, skip_special_tokens=True))
    assert len(set(texts)) == len(texts)  # images and words really change the text
    assert all(len(t.split()) > NUM_NEW // 2 for t in texts)  # mostly words, not specials
    return folder, texts


async def _chat_all(base_url: str) -> list[str]:
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(text: str, specs: list[tuple[int, int, int, str]]) -> str:
        urls = [
            f"data:image/png;base64,{base64.b64encode(png_bytes(image)).decode()}"
            for image in _images(specs)
        ]
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": _parts(text, urls)}],  # type: ignore[list-item,misc]
            max_completion_tokens=NUM_NEW,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    try:
        return await asyncio.gather(*(one(t, s) for t, s in CASES))
    finally:
        await client.close()


@pytest.mark.parametrize(
    "layout",
    [
        ("--mode", "colocated", "--prefill", "1", "--decode", "0"),
        ("--prefill", "1", "--decode", "1"),
        ("--encode", "1", "--prefill", "1", "--decode", "1"),
    ],
    ids=["colocated", "prefill_decode_over_nixl", "encode_prefill_decode"],
)
def test_image_chats_equal_transformers_generate(
    checkpoint: tuple[Path, list[str]], tmp_path: Path, layout: tuple[str, ...]
) -> None:
    folder, expected = checkpoint
    with baton_serve(
        vllm_serve_args(folder, tmp_path, 2.0, *layout), serve_env(), ready_s=240
    ) as base:
        served = asyncio.run(_chat_all(base))
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    # Word-level tokens: the words, in order, are the tokens (specials are not shown).
    assert [t.split() for t in served] == [t.split() for t in expected]
    images = {
        source: _gauge(metrics, "baton_worker_images", worker="encode-0", source=source)
        for source in ("encoded", "cached")
    }
    if "--encode" in layout:  # 7 images sent, 6 distinct: case 5 repeats case 0's
        assert images == {"encoded": 6, "cached": 1}
    else:  # vLLM encoded them on the prefilling worker
        assert images == {"encoded": None, "cached": None}


def _gauge(metrics: str, name: str, **labels: str) -> float | None:
    wanted = {f'{k}="{v}"' for k, v in labels.items()}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            series, value = line.rsplit(" ", 1)
            if wanted <= set(series[len(name) + 1 : -1].split(",")):
                return float(value)
    return None
