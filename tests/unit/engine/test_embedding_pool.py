"""Image embeddings move between workers through kvtransfer, as a second registered region.

The encode side stores embeddings in slots and holds them under a lease; the prefill
side pulls them into its own slots and gets the same bits, which then give the same
text as encoding in place. An unpulled hold is freed when its lease runs out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from kvtransfer import (
    KVConnector,
    TransferState,
    UnknownHandleError,
    available_backends,
    make_connector,
)
from services.engine.embedding_pool import MM_REGION, EmbeddingPool
from services.engine.loader import load_model
from services.engine.messages import EngineRequest
from services.engine.placeholders import TINY_VL_IMAGE_PROMPT
from tests.unit.engine.engine_helpers import greedy, make_engine, serve
from tests.unit.engine.llava_twin import image_inputs, random_image

TIMEOUT_S = 10.0


def test_slots_round_trip_with_an_odd_hidden_size() -> None:
    pool = EmbeddingPool(num_slots=3, num_image_tokens=5, hidden_size=7)
    images = torch.randn(2, 5, 7)
    slots = pool.store(images)
    assert pool.num_free_slots == 1
    assert torch.equal(pool.load(slots), images)
    pool.free(slots)
    assert pool.num_free_slots == 3
    with pytest.raises(ValueError, match="4 slots asked"):
        pool.allocate(4)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture(params=["local", "nixl"])
def connectors(request: pytest.FixtureRequest) -> Iterator[tuple[KVConnector, KVConnector]]:
    name: str = request.param
    if name not in available_backends():
        pytest.skip(f"backend {name} is not installed")
    encode = make_connector(name, agent_name=f"enc-{name}", transfer_timeout_s=TIMEOUT_S)
    prefill = make_connector(name, agent_name=f"pre-{name}", transfer_timeout_s=TIMEOUT_S)
    yield encode, prefill
    prefill.close()
    encode.close()


def _pools(encode: KVConnector, prefill: KVConnector) -> tuple[EmbeddingPool, EmbeddingPool]:
    spec = TINY_VL_IMAGE_PROMPT
    hidden = load_model("tiny-vl").args.hidden_size
    pools = (
        EmbeddingPool(4, spec.num_image_tokens, hidden),
        EmbeddingPool(6, spec.num_image_tokens, hidden),
    )
    encode.register(MM_REGION, pools[0].storage, pools[0].layout)
    prefill.register(MM_REGION, pools[1].storage, pools[1].layout)
    return pools


def test_pulled_embeddings_are_the_encoded_ones_and_give_the_same_text(
    connectors: tuple[KVConnector, KVConnector],
) -> None:
    encode, prefill = connectors
    encode_pool, prefill_pool = _pools(encode, prefill)
    vl = load_model("tiny-vl")
    assert vl.vision is not None
    images = [random_image(1, 48, 40), random_image(2, 20, 60)]
    encoded = vl.vision.encode(images)

    handle = encode.hold(MM_REGION, encode_pool.store(encoded), on_release=encode_pool.free)
    assert encode_pool.num_free_slots == 2
    landing = prefill_pool.allocate(len(images))
    transfer_id = prefill.pull(handle, MM_REGION, landing)
    deadline_s = time.monotonic() + TIMEOUT_S
    while not (state := prefill.poll(transfer_id)).is_final and time.monotonic() < deadline_s:
        encode.progress()
        prefill.progress()
    assert state is TransferState.DONE
    pulled = prefill_pool.load(landing)
    prefill_pool.free(landing)
    assert torch.equal(pulled, encoded)
    for _ in range(100):  # the holder learns of the completion and frees its slots
        encode.progress()
        if encode_pool.num_free_slots == 4:
            break
        time.sleep(0.01)
    assert encode_pool.num_free_slots == 4

    # Placed by the prefill engine, the pulled embeddings give the encoded text.
    engine = make_engine("tiny-vl")
    spec = TINY_VL_IMAGE_PROMPT
    prompt = [72, 105] + [spec.image_token_id] * 32 + [33, 63]
    inputs = image_inputs(prompt, images, spec.image_token_id, spec.num_image_tokens)
    in_place = serve(engine, [EngineRequest("a", tuple(prompt), greedy(8), images=inputs)])
    handed = tuple(
        dataclasses.replace(i, content_hash=f"other-{n}", data=None, embeddings=e)
        for n, (i, e) in enumerate(zip(inputs, pulled))
    )
    moved = serve(engine, [EngineRequest("b", tuple(prompt), greedy(8), images=handed)])
    assert moved["b"] == in_place["a"]


def test_an_unpulled_hold_is_freed_when_its_lease_expires() -> None:
    clock = FakeClock()
    encode = make_connector("local", agent_name="enc-lease", lease_s=1.0, clock=clock)
    prefill = make_connector("local", agent_name="pre-lease", clock=clock)
    try:
        encode_pool, prefill_pool = _pools(encode, prefill)
        handle = encode.hold(
            MM_REGION, encode_pool.store(torch.zeros(2, 16, 64)), on_release=encode_pool.free
        )
        clock.now_s += 2.0
        encode.progress()
        assert encode_pool.num_free_slots == 4
        with pytest.raises(UnknownHandleError):
            prefill.pull(handle, MM_REGION, prefill_pool.allocate(2))
    finally:
        prefill.close()
        encode.close()
