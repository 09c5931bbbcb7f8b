"""The front door with encode workers: image requests queue on the least-loaded
encoder until it answers, and a request's images are cut over encoders (by their
tokens where they differ), each encoder queueing its part (see test_front_door.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.profile import EncodeCoeffs
from router.types import Plan, RequestProfile, Role
from tests.unit.router.builders import PROFILE
from tests.unit.router.test_front_door import request, router, snapshot


def _image_request(request_id: str, image_tokens: int = 200) -> RequestProfile:
    return replace(request(request_id), num_image_tokens=image_tokens, num_images=1)


@pytest.mark.parametrize("policy", ["round_robin", "slo_goodput"])
def test_image_requests_queue_on_the_least_loaded_encode_worker_until_it_answers(
    policy: str,
) -> None:
    r = router(policy=policy)
    r.update(snapshot("e0", Role.ENCODE))
    r.update(snapshot("e1", Role.ENCODE))
    first = r.place(_image_request("a"), 0.0)
    second = r.place(_image_request("b"), 0.0)
    assert isinstance(first, Plan) and isinstance(second, Plan)
    assert {first.encode_worker, second.encode_worker} == {"e0", "e1"}
    queued = {w.worker_id: sum(w.queued_tokens.values()) for w in r.view().workers}
    assert (queued["e0"], queued["e1"]) == (200, 200)
    r.release("a", first.encode_worker)  # its encode worker answered
    queued = {w.worker_id: sum(w.queued_tokens.values()) for w in r.view().workers}
    assert queued[first.encode_worker] == 0 and queued[second.encode_worker] == 200
    text = r.place(request("c"), 0.0)
    assert isinstance(text, Plan) and text.encode_worker is None  # no images, no encode


def test_a_policy_that_does_not_price_encodes_spreads_images_over_the_least_queued() -> None:
    r = router(policy="round_robin")
    for wid in ("e0", "e1", "e2"):
        r.update(snapshot(wid, Role.ENCODE))
    busy = r.place(_image_request("busy", image_tokens=500), 0.0)  # one image: on e0
    assert isinstance(busy, Plan) and busy.encode_workers == ("e0",)
    three = replace(_image_request("three", image_tokens=300), num_images=3)
    plan = r.place(three, 0.0)
    assert isinstance(plan, Plan)
    assert plan.encode_parts == (("e1", 0, 1), ("e2", 1, 2), ("e0", 2, 3))
    queued = {w.worker_id: sum(w.queued_tokens.values()) for w in r.view().workers}
    assert (queued["e0"], queued["e1"], queued["e2"]) == (600, 100, 100)  # each its share
    r.release("three", "e1")  # e1 answered: its share is off its queue, the others' stay
    queued = {w.worker_id: sum(w.queued_tokens.values()) for w in r.view().workers}
    assert (queued["e0"], queued["e1"], queued["e2"]) == (600, 0, 100)
    # Images of different sizes: cut by tokens, each worker queued its part's tokens.
    mixed = replace(
        _image_request("mixed", image_tokens=900), num_images=3, image_tokens=(100, 100, 700)
    )
    plan = r.place(mixed, 0.0)
    assert isinstance(plan, Plan)
    # e1 is the least queued (0, then e2 100, e0 600): the large image goes there.
    assert plan.encode_parts == (("e2", 0, 1), ("e0", 1, 2), ("e1", 2, 3))
    queued = {w.worker_id: sum(w.queued_tokens.values()) for w in r.view().workers}
    assert (queued["e0"], queued["e1"], queued["e2"]) == (700, 700, 200)


def test_encodes_queued_on_a_worker_that_encodes_its_own_prompts_images_lengthen_its_wait() -> None:
    """Encode colocated (no encode workers; vLLM encodes files in the step that starts
    the prompt): a prompt queued behind images waits for their encode too, whether the
    worker's report says they wait there or the router placed them there."""
    encode = EncodeCoeffs(a=0.01, b=1e-4)
    r = router(policy="slo_goodput", profile=replace(PROFILE, encode=encode))

    def predicted(seq: int, waiting: tuple[int, ...], images: tuple[int, ...]) -> float:
        r.update(
            replace(
                snapshot("p", Role.PREFILL, seq=seq, waiting=waiting), waiting_image_tokens=images
            )
        )
        plan = r.place(request(f"t{seq}", prompt=100), 0.0)
        assert isinstance(plan, Plan) and plan.predicted_ttft_s is not None
        r.release(f"t{seq}")
        return plan.predicted_ttft_s

    tokens_only = predicted(2, (1100,), ())
    behind_images = predicted(3, (1100,), (1024,))
    assert behind_images - tokens_only == pytest.approx(encode.encode_s(1024))
    view = {w.worker_id: w for w in r.view().workers}["p"]
    assert (view.queued_encodes, view.queued_encode_tokens) == (1, 1024)

    # Placed here with images and no encode worker: its encode queues here until p's
    # first event for it.
    r.update(snapshot("p", Role.PREFILL, seq=4))
    plan = r.place(_image_request("img", image_tokens=200), 0.0)
    assert isinstance(plan, Plan) and plan.encode_worker is None
    view = {w.worker_id: w for w in r.view().workers}["p"]
    assert (view.queued_encodes, view.queued_encode_tokens) == (1, 200)
    r.release("img", "p")
    view = {w.worker_id: w for w in r.view().workers}["p"]
    assert (view.queued_encodes, view.queued_encode_tokens) == (0, 0)


def test_images_placed_on_an_encode_worker_queue_no_encode_on_the_prefill_worker() -> None:
    r = router(policy="slo_goodput")
    r.update(snapshot("e0", Role.ENCODE))
    plan = r.place(_image_request("img", image_tokens=200), 0.0)
    assert isinstance(plan, Plan) and plan.encode_worker == "e0"
    view = {w.worker_id: w for w in r.view().workers}["p"]
    assert (view.queued_encodes, view.queued_encode_tokens) == (0, 0)


def test_a_request_encoding_on_encode_workers_joins_its_prefill_queue_when_they_answer() -> None:
    """Its images on encode workers, a request reaches its prefill worker only when the
    last part lands: until then a prompt placed there goes ahead of it, so it is not in
    that worker's queue, nor its oldest waiting prompt."""
    r = router(policy="slo_goodput")
    r.update(snapshot("e0", Role.ENCODE))
    r.update(snapshot("e1", Role.ENCODE))
    image = replace(_image_request("img", image_tokens=400), num_images=2)
    plan = r.place(image, 0.0)
    assert isinstance(plan, Plan) and set(plan.encode_workers) == {"e0", "e1"}

    def queued_on_p() -> int:
        return sum({w.worker_id: w for w in r.view().workers}["p"].queued_tokens.values())

    def text_ttft(request_id: str) -> float:
        text = r.place(request(request_id, prompt=100), 0.5)
        assert isinstance(text, Plan) and text.predicted_ttft_s is not None
        r.release(request_id)
        return text.predicted_ttft_s

    assert queued_on_p() == 0 and r.pending_age_s("p", 0.5) == 0.0
    ahead_of_it = text_ttft("t1")
    r.release("img", plan.encode_workers[0])  # one part landed: still encoding
    assert queued_on_p() == 0
    r.release("img", plan.encode_workers[1])  # the last: it is sent to p now
    assert queued_on_p() == image.num_prompt_tokens + image.num_image_tokens
    assert r.pending_age_s("p", 0.5) == 0.5
    assert text_ttft("t2") > ahead_of_it  # now it is ahead of a new prompt
