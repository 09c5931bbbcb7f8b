"""The engine serves image requests: greedy outputs equal transformers' generate on tiny-vl.

Six image+text requests (one, two or no images, sizes that need resizing and cropping)
run together in one continuous batch, with prefill chunks that cut images in two;
then again from precomputed embeddings (what an encode worker hands over), and a
repeated image is encoded once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from PIL import Image

from services.engine.engine import LLMEngine
from services.engine.llava import LoadedVision
from services.engine.loader import load_model
from services.engine.messages import EngineRequest, ImageInput, InvalidRequestError
from services.engine.placeholders import expand_image_tokens
from tests.unit.engine.engine_helpers import greedy, make_engine, run_all, serve, tokens_of
from tests.unit.engine.llava_twin import image_inputs, random_image, tiny_vl_twin

NUM_NEW = 32

# (text before, images, text after); an image part renders as <|image|> in the template.
CASES: list[tuple[str, list[tuple[int, int, int]]]] = [
    ("what is in this picture?", [(1, 48, 40)]),
    ("compare", [(2, 30, 56), (3, 64, 64)]),
    ("no image here, just words", []),
    ("a", [(4, 32, 32)]),
    ("describe both, briefly please", [(5, 100, 20), (6, 33, 47)]),
    ("and this one", [(7, 40, 40)]),
]


def _vision(engine: LLMEngine) -> LoadedVision:
    assert engine.images.vision is not None
    return engine.images.vision


def _prompt(engine: LLMEngine, text: str, num_images: int) -> list[int]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    content = parts * num_images + [{"type": "text", "text": text}]
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    v = _vision(engine)
    return expand_image_tokens(engine.tokenizer.encode(chat), v.image_token_id, v.num_image_tokens)


@pytest.fixture(scope="module")
def cases() -> list[tuple[list[int], list[Image.Image], list[int]]]:
    """(prompt, images, transformers' 32 greedy tokens) per case."""
    engine = make_engine("tiny-vl")
    twin = tiny_vl_twin(load_model("tiny-vl"))  # the engine's weights: the same seed
    twin.generation_config.eos_token_id = None  # exactly NUM_NEW tokens, as ignore_eos
    out = []
    for text, specs in CASES:
        images = [random_image(seed, w, h) for seed, w, h in specs]
        prompt = _prompt(engine, text, len(images))
        pixels = {"pixel_values": _vision(engine).processor.preprocess(images)} if images else {}
        with torch.no_grad():
            generated = twin.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                **pixels,
                max_new_tokens=NUM_NEW,
                do_sample=False,
                pad_token_id=0,
            )
        out.append((prompt, images, generated[0, len(prompt) :].tolist()))
    return out


def _requests(
    engine: LLMEngine, cases: list[tuple[list[int], list[Image.Image], list[int]]]
) -> list[EngineRequest]:
    v = _vision(engine)
    return [
        EngineRequest(
            f"r{i}",
            tuple(prompt),
            greedy(NUM_NEW),
            images=image_inputs(prompt, images, v.image_token_id, v.num_image_tokens),
        )
        for i, (prompt, images, _) in enumerate(cases)
    ]


def test_six_image_requests_together_equal_transformers_generate(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    # Chunks of 24 tokens cut 16-token images in two across steps.
    engine = make_engine("tiny-vl", max_num_batched_tokens=24)
    got = serve(engine, _requests(engine, cases))
    for i, (_, _, expected) in enumerate(cases):
        assert got[f"r{i}"] == expected, f"request {i}"
    stats = engine.stats()
    assert stats.num_images_encoded == sum(len(images) for _, images, _ in cases)


def test_precomputed_embeddings_give_the_same_text(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    encoder_side = make_engine("tiny-vl")
    engine = make_engine("tiny-vl")
    requests = []
    for r, (_, images, _) in zip(_requests(engine, cases), cases):
        embeds = _vision(encoder_side).encode(images) if images else []
        handed = tuple(
            dataclasses.replace(image, data=None, embeddings=e)
            for image, e in zip(r.images, embeds)
        )
        requests.append(dataclasses.replace(r, images=handed))
    got = serve(engine, requests)
    for i, (_, _, expected) in enumerate(cases):
        assert got[f"r{i}"] == expected, f"request {i}"
    assert engine.stats().num_images_encoded == 0  # it placed them, never encoded


def test_a_repeated_image_is_encoded_once_and_reuses_blocks(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    engine = make_engine("tiny-vl")
    first = _requests(engine, cases)[0]
    out1 = serve(engine, [first])
    out2 = serve(engine, [dataclasses.replace(first, request_id="again")])
    assert out1["r0"] == out2["again"] == cases[0][2]
    stats = engine.stats()
    assert (stats.num_images_encoded, stats.num_image_cache_hits) == (1, 1)
    assert stats.num_prefix_hit_tokens >= len(first.prompt_token_ids) - 4


def test_a_different_image_with_the_same_text_does_not_hit_its_blocks(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    engine = make_engine("tiny-vl")
    first = _requests(engine, cases)[0]
    serve(engine, [first])
    hits_before = engine.stats().num_prefix_hit_tokens
    prompt, _, expected = cases[0]
    v = _vision(engine)
    other = image_inputs(prompt, [random_image(99, 48, 40)], v.image_token_id, 16)
    got = serve(engine, [dataclasses.replace(first, request_id="other", images=other)])
    assert got["other"] != expected  # the image matters to the output
    # Only whole blocks before the image may be shared.
    image_offset = first.images[0].offset
    assert engine.stats().num_prefix_hit_tokens - hits_before <= image_offset


@pytest.mark.parametrize(
    "change",
    [
        lambda img: dataclasses.replace(img, offset=img.offset + 1),
        lambda img: dataclasses.replace(img, num_tokens=img.num_tokens - 1),
        lambda img: dataclasses.replace(img, data=b"\x89PNG\r\n\x1a\n truncated"),
        lambda img: dataclasses.replace(img, data=None),
    ],
    ids=["off_placeholders", "wrong_length", "undecodable", "no_data"],
)
def test_bad_images_are_invalid_requests(
    cases: list[tuple[list[int], list[Image.Image], list[int]]], change: Any
) -> None:
    engine = make_engine("tiny-vl")
    request = _requests(engine, cases)[0]
    bad: ImageInput = change(request.images[0])
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(dataclasses.replace(request, images=(bad,)))
    assert err.value.param == "messages"
    assert not engine.has_unfinished()
    assert serve(engine, [request])["r0"] == cases[0][2]  # and it keeps serving


def test_a_text_model_refuses_images(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    vl = make_engine("tiny-vl")
    request = _requests(vl, cases)[0]
    engine = make_engine("tiny")
    text_only = dataclasses.replace(
        request, prompt_token_ids=tuple(min(t, 255) for t in request.prompt_token_ids)
    )
    with pytest.raises(InvalidRequestError, match="does not take images"):
        engine.add_request(text_only)


def test_an_adopted_image_request_recomputed_after_preemption_keeps_its_text(
    cases: list[tuple[list[int], list[Image.Image], list[int]]],
) -> None:
    """KV pulled from a prefill engine; then the decode engine preempts the request and
    recomputes its prompt, encoding its images only now (no prefix cache to hit)."""
    prefill = make_engine("tiny-vl")
    decode = make_engine("tiny-vl", enable_prefix_caching=False)
    request = _requests(prefill, cases)[1]  # two images
    prefill.add_request(dataclasses.replace(request, prefill_only=True))
    last = run_all(prefill)[request.request_id][-1]
    assert last.held_kv is not None
    continued = dataclasses.replace(request, output_token_ids=last.new_token_ids)
    local = decode.adopt(continued)
    decode.kv[local] = prefill.kv[list(last.held_kv.block_ids)]  # what a pull would land
    decode.start_adopted(request.request_id)
    tokens = list(continued.output_token_ids)
    for _ in range(5):
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert decode.stats().num_images_encoded == 0  # the KV came with the images in it
    r = decode.scheduler.running[0]
    decode.scheduler.running.remove(r)
    decode.scheduler._preempt(r)  # as when the pool runs short
    tokens += tokens_of(run_all(decode)[request.request_id])
    assert tokens == cases[1][2]
    assert decode.stats().num_images_encoded == 2
