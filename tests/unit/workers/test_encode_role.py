"""The encode role on real in-process workers (tiny-vl, local connector).

An encode worker encodes a request's images and holds the embeddings in region ``mm``;
a prefill worker pulls them and generates the same tokens as encoding in place. A
repeated image is served by the encoder-output cache; embeddings nobody can pull any
more fail the pull (a re-plan), never hang it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvtransfer import make_connector
from router.types import Role
from services.engine.messages import EngineRequest
from services.engine.placeholders import TINY_VL_IMAGE_PROMPT
from services.workers.messages import (
    Encode,
    FailureKind,
    Generate,
    ImagesEncoded,
    ImagesPulled,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
)
from services.workers.worker import Worker, WorkerSpec
from tests.unit.engine.engine_helpers import greedy, make_engine
from tests.unit.engine.llava_twin import image_inputs, random_image

pytestmark = pytest.mark.asyncio

SPEC = TINY_VL_IMAGE_PROMPT


def _engine() -> Any:
    return make_engine("tiny-vl")


def _connector(agent: str) -> Any:
    return make_connector("local", agent_name=agent, lease_s=5.0, transfer_timeout_s=5.0)


def _request(request_id: str, seeds: list[int], text_ids: tuple[int, ...] = (5, 6, 7)) -> Any:
    per = SPEC.num_image_tokens
    prompt = [1]
    for _ in seeds:
        prompt += [SPEC.image_token_id] * per
    prompt += list(text_ids)
    images = image_inputs(
        prompt, [random_image(s, 40, 36) for s in seeds], SPEC.image_token_id, per
    )
    return EngineRequest(request_id, tuple(prompt), greedy(8), images=images)


@pytest.fixture
def workers() -> Iterator[dict[str, Worker]]:
    made = {
        name: Worker(WorkerSpec(name, role, _engine, _connector, telemetry_interval_s=0.05))
        for name, role in (("enc", Role.ENCODE), ("pre", Role.MIXED))
    }
    yield made
    for w in made.values():
        w._loop.stop()


async def _all(events: AsyncIterator[WorkerEvent]) -> list[WorkerEvent]:
    return [e async for e in events]


def _tokens(events: list[WorkerEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]


async def test_pulled_embeddings_give_the_tokens_of_encoding_in_place(
    workers: dict[str, Worker],
) -> None:
    enc, pre = workers["enc"], workers["pre"]
    request = _request("r", [1, 2])
    in_place = _tokens(await _all(pre.generate(Generate(replace(request, request_id="ref")))))

    encoded = await _all(enc.generate(Encode(request)))
    assert len(encoded) == 1 and isinstance(encoded[0], ImagesEncoded), encoded
    handle = encoded[0].handle
    assert encoded[0].num_images == 2 and encoded[0].num_encoded == 2
    assert handle.region == "mm" and len(handle.block_ids) == 2

    # The prefill worker gets no image data: only the pulled embeddings can steer it.
    blind = tuple(replace(i, data=None) for i in request.images)
    job = Generate(replace(request, images=blind), images=handle)
    events = await _all(pre.generate(job))
    assert isinstance(events[0], ImagesPulled) and events[0].num_bytes > 0
    assert _tokens(events) == in_place and len(in_place) == 8
    assert (await pre.snapshot()).num_images_encoded == 2  # only its own in-place run
    # The puller's completion released the hold: every slot is free again.
    for _ in range(50):
        if enc._loop._images.num_held == 0:
            break
        await asyncio.sleep(0.02)
    assert enc._loop._images.num_held == 0


async def test_images_split_over_two_encode_workers_give_the_tokens_of_encoding_in_place() -> None:
    """Three images: the first on one encode worker, the other two on another; the
    prefill worker pulls both parts (``more_images``) and starts when both landed."""
    made = {
        name: Worker(WorkerSpec(name, role, _engine, _connector, telemetry_interval_s=0.05))
        for name, role in (("enc-a", Role.ENCODE), ("enc-b", Role.ENCODE), ("pre", Role.MIXED))
    }
    try:
        request = _request("split", [1, 2, 3])
        pre = made["pre"]
        in_place = _tokens(await _all(pre.generate(Generate(replace(request, request_id="ref")))))
        first = replace(request, images=request.images[:1])
        rest = replace(request, images=request.images[1:])
        part_a, part_b = await asyncio.gather(
            _all(made["enc-a"].generate(Encode(first))), _all(made["enc-b"].generate(Encode(rest)))
        )
        assert isinstance(part_a[0], ImagesEncoded) and isinstance(part_b[0], ImagesEncoded)
        assert (part_a[0].num_images, part_b[0].num_images) == (1, 2)
        blind = tuple(replace(i, data=None) for i in request.images)
        job = Generate(
            replace(request, images=blind), images=part_a[0].handle, more_images=(part_b[0].handle,)
        )
        events = await _all(pre.generate(job))
        assert isinstance(events[0], ImagesPulled) and events[0].num_bytes > 0
        assert _tokens(events) == in_place and len(in_place) == 8
        assert (await pre.snapshot()).num_images_encoded == 3  # only its own in-place run
        # One part's hold gone (the other held): the whole pull fails, a re-plan, no hang.
        held_a, gone_b = await asyncio.gather(
            _all(made["enc-a"].generate(Encode(replace(first, request_id="gone")))),
            _all(made["enc-b"].generate(Encode(replace(rest, request_id="gone")))),
        )
        assert isinstance(held_a[0], ImagesEncoded) and isinstance(gone_b[0], ImagesEncoded)
        await made["enc-b"].abort("gone")
        await asyncio.sleep(0.05)
        job = Generate(
            replace(request, request_id="gone", images=blind),
            images=held_a[0].handle,
            more_images=(gone_b[0].handle,),
        )
        events = await _all(pre.generate(job))
        assert isinstance(events[-1], RequestFailed), events
        assert events[-1].kind is FailureKind.TRANSFER
        assert _tokens(events) == []
    finally:
        for w in made.values():
            w._loop.stop()


async def test_a_repeated_image_is_encoded_once(workers: dict[str, Worker]) -> None:
    enc = workers["enc"]
    first = await _all(enc.generate(Encode(_request("a", [3]))))
    again = await _all(enc.generate(Encode(_request("b", [3], text_ids=(9, 9)))))
    assert isinstance(first[0], ImagesEncoded) and isinstance(again[0], ImagesEncoded)
    assert (first[0].num_encoded, again[0].num_encoded) == (1, 0)
    snapshot = await enc.snapshot()
    assert (snapshot.num_images_encoded, snapshot.num_image_cache_hits) == (1, 1)


async def test_embeddings_released_before_the_pull_fail_it(workers: dict[str, Worker]) -> None:
    enc, pre = workers["enc"], workers["pre"]
    request = _request("gone", [4])
    encoded = await _all(enc.generate(Encode(request)))
    assert isinstance(encoded[0], ImagesEncoded)
    await enc.abort("gone")  # e.g. the encode worker gave them up: the hold is released
    await asyncio.sleep(0.05)
    events = await _all(pre.generate(Generate(request, images=encoded[0].handle)))
    assert isinstance(events[-1], RequestFailed), events
    assert events[-1].kind is FailureKind.TRANSFER
    assert _tokens(events) == []
