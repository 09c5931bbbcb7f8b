"""Image requests through real Ray workers: six served together equal transformers' generate.

tiny-vl, 32 greedy tokens each, colocated (in-process: the worker encodes its own
images) and E/P/D with 1 encode + 1 prefill + 1 decode worker over ``nixl`` and over
``torch``: the encode worker encodes the images and holds their embeddings, the
prefill worker pulls them (region ``mm``), the decode worker pulls the prompt's KV;
and with 2 encode workers (``nixl``), each request's images split over both.
The oracle is ``transformers``' LlavaForConditionalGeneration holding the same weights.
(Prefill workers that encode their own images in P/D: tests/unit/workers and the
engine tests.)
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from services.engine.loader import load_model
from services.engine.messages import SamplingParams
from services.engine.placeholders import TINY_VL_IMAGE_PROMPT, expand_image_tokens
from services.workers.messages import TokenDelta
from tests.support.cluster import real_service, tiny_config, worker_snapshots
from tests.support.server import ServedGateway
from tests.unit.engine.llava_twin import image_inputs, png_bytes, random_image, tiny_vl_twin

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny-vl"
NUM_NEW = 32
NUM_LONG = 160  # a stream long enough to be mid-way when the test kills its worker
# (text, images as (seed, width, height)): one, two or no images, sizes that resize and crop
CASES = [
    ("what is in this picture?", [(1, 48, 40)]),
    ("compare", [(2, 30, 56), (3, 64, 64)]),
    ("no image here, just words", []),
    ("a", [(4, 32, 32)]),
    ("describe both, briefly please", [(5, 100, 20), (6, 33, 47)]),
    ("and this one", [(7, 40, 40)]),
]


def _config(**overrides: Any) -> Any:
    return tiny_config(**{"model.name": MODEL, "engine.block_size": 4, **overrides})


@pytest.fixture  # one cluster at a time: the CI box has two cores
def colocated() -> Iterator[ServedGateway]:
    config = _config(**{"workers.mode": "colocated", "workers.prefill": 1, "workers.decode": 0})
    with ServedGateway(real_service(config, ray=False)) as server:
        yield server


@pytest.fixture  # one cluster at a time: the CI box has two cores
def nixl_epd(ray_cluster: str) -> Iterator[ServedGateway]:
    config = _config(**{"kvtransfer.backend": "nixl", "workers.encode": 1})
    with ServedGateway(real_service(config, ray=True, replace_dead=True)) as s:
        yield s


@pytest.fixture  # one cluster at a time: the CI box has two cores
def torch_epd(ray_cluster: str) -> Iterator[ServedGateway]:
    config = _config(**{"kvtransfer.backend": "torch", "workers.encode": 1})
    with ServedGateway(real_service(config, ray=True)) as s:
        yield s


@pytest.fixture  # one cluster at a time: the CI box has two cores
def split_epd(ray_cluster: str) -> Iterator[ServedGateway]:
    """Two encode workers: round_robin spreads each request's images over both."""
    config = _config(**{"kvtransfer.backend": "nixl", "workers.encode": 2})
    with ServedGateway(real_service(config, ray=True)) as s:
        yield s


def _content(text: str, pngs: list[bytes]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_b64(p)}"}}
        for p in pngs
    ]
    return [*parts, {"type": "text", "text": text}]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _transformers_texts(cases: list[Any], num_new: int) -> list[str]:
    """transformers' ``num_new`` greedy tokens per case, as text."""
    loaded = load_model(MODEL)
    assert loaded.vision is not None
    twin = tiny_vl_twin(loaded)
    twin.generation_config.eos_token_id = None  # exactly num_new tokens, as ignore_eos
    spec = TINY_VL_IMAGE_PROMPT
    texts = []
    for text, specs in cases:
        images = [random_image(*s) for s in specs]
        chat = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": _content(text, [b""] * len(images))}]
        )
        raw = loaded.tokenizer.encode(chat, add_special_tokens=False)
        prompt = expand_image_tokens(raw, spec.image_token_id, spec.num_image_tokens)
        extra = {"pixel_values": loaded.vision.processor.preprocess(images)} if images else {}
        with torch.no_grad():
            out = twin.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=num_new,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
        texts.append(loaded.tokenizer.decode(out[0, len(prompt) :].tolist()))
    return texts


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """transformers' NUM_NEW greedy tokens per case, as text."""
    return _transformers_texts(CASES, NUM_NEW)


async def _chat_all(
    base_url: str, cases: list[tuple[str, list[tuple[int, int, int]]]] = CASES
) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(text: str, specs: list[tuple[int, int, int]]) -> str:
            pngs = [png_bytes(random_image(*s)) for s in specs]
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": _content(text, pngs)}],
                "max_completion_tokens": NUM_NEW,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            content: str = r.json()["choices"][0]["message"]["content"]
            return content

        return await asyncio.gather(*(one(t, s) for t, s in cases))


@pytest.mark.parametrize("serving", ["colocated", "nixl_epd", "torch_epd"])
def test_six_image_requests_together_equal_transformers(
    serving: str, expected: list[str], request: pytest.FixtureRequest
) -> None:
    server: ServedGateway = request.getfixturevalue(serving)
    got = asyncio.run(_chat_all(server.base_url))
    assert got == expected
    assert len(set(expected)) == len(CASES)  # the images and texts really steer the output
    snapshots = worker_snapshots(server)
    encoded = {w: s.num_images_encoded for w, s in snapshots.items()}
    num_images = sum(len(specs) for _, specs in CASES)
    if serving == "colocated":
        assert sum(encoded.values()) == num_images
    else:  # every image was encoded on the encode worker, none on prefill or decode
        assert encoded == {"encode-0": num_images, "prefill-0": 0, "decode-0": 0}
        # ... and the same image sent again is served by its encoder-output cache
        again = asyncio.run(_chat_all(server.base_url, CASES[:1]))
        assert again == expected[:1]
        after = worker_snapshots(server)["encode-0"]
        assert (after.num_images_encoded, after.num_image_cache_hits) == (num_images, 1)


def test_images_split_over_two_encode_workers_equal_transformers(
    split_epd: ServedGateway, expected: list[str]
) -> None:
    """Each two-image request's images are encoded one on each encode worker at once;
    the prefill worker pulls both parts and its text equals transformers'."""
    two_images = [1, 4]
    got = asyncio.run(_chat_all(split_epd.base_url, [CASES[i] for i in two_images]))
    assert got == [expected[i] for i in two_images]
    encoded = {w: s.num_images_encoded for w, s in worker_snapshots(split_epd).items()}
    assert encoded == {"encode-0": 2, "encode-1": 2, "prefill-0": 0, "decode-0": 0}


def test_a_dead_decode_worker_mid_image_stream_gives_the_same_text(
    nixl_epd: ServedGateway,
) -> None:
    """The continuation re-prefills prompt, images and streamed tokens on a live worker.

    A long stream (NUM_LONG tokens, the worker killed after 8): with 32 a fast decode
    worker could finish the whole stream before the test read its 8th token, and the
    kill then found nothing to fail over (no retry counted; seen once)."""
    import ray

    expected = _transformers_texts(CASES[1:2], NUM_LONG)[0]
    text, specs = CASES[1]  # two images
    images = [random_image(*s) for s in specs]
    tokenizer = nixl_epd.svc.tokenizer
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": _content(text, [b""] * len(images))}]
    )
    spec = TINY_VL_IMAGE_PROMPT
    prompt = expand_image_tokens(
        tokenizer.encode(chat, add_special_tokens=False), spec.image_token_id, spec.num_image_tokens
    )
    inputs = image_inputs(prompt, images, spec.image_token_id, spec.num_image_tokens)
    sampling = SamplingParams(max_tokens=NUM_LONG, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[int], set[str]]:
        tokens: list[int] = []
        workers: set[str] = set()
        killed = False
        stream = nixl_epd.svc.generate(
            "image-death", tuple(prompt), sampling, time.monotonic(), images=inputs
        )
        async for delta in stream:
            assert isinstance(delta, TokenDelta)
            tokens.extend(delta.token_ids)
            workers.add(delta.worker_id)
            if not killed and len(tokens) >= 8 and delta.worker_id.startswith("decode"):
                client = nixl_epd.svc.controller.client(delta.worker_id)
                ray.kill(client.actor, no_restart=True)  # type: ignore[union-attr]
                killed = True
        return tokens, workers

    tokens, workers = nixl_epd.call(run(), timeout_s=180)
    assert tokenizer.decode(tokens) == expected
    assert nixl_epd.svc.metrics.retries.labels("worker_died")._value.get() >= 1, workers


def test_a_dead_encode_worker_holding_embeddings_gives_the_same_text(
    nixl_epd: ServedGateway, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encode worker dies after it encoded the images, before the prefill pulled
    them: the pull fails, the request is re-planned and its text is unchanged."""
    import ray

    svc = nixl_epd.svc
    runner = svc.executor._runner
    encode = runner._encode
    killed: list[str] = []

    async def encode_then_die(encode_id: str, *args: Any) -> Any:
        handle = await encode(encode_id, *args)
        if not killed:
            client = svc.controller.client(encode_id)
            ray.kill(client.actor, no_restart=True)  # type: ignore[union-attr]
            killed.append(encode_id)
        return handle

    monkeypatch.setattr(runner, "_encode", encode_then_die)
    got = asyncio.run(_chat_all(nixl_epd.base_url, CASES[1:2]))
    assert killed == ["encode-0"]
    assert got == expected[1:2]
    assert sum(c._value.get() for c in _retry_counters(svc)) >= 1


def _retry_counters(svc: Any) -> list[Any]:
    return [svc.metrics.retries.labels(reason) for reason in ("transfer", "worker_died")]
