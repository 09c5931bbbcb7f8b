"""slo_goodput with images: which encode worker (or none) and how a request's images
are split, on constructed views (``builders.PROFILE``; see test_slo_goodput.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from router.policies.slo_goodput import SloGoodput
from router.profile import save_profile
from router.types import Role
from tests.unit.router.builders import PROFILE, plan_of, policy, prefill_s, request, view, worker

PROMPT = 500


@pytest.fixture
def pol(tmp_path: Path) -> SloGoodput:
    """slo_goodput seeded with ``builders.PROFILE``, which has an encode term, from a file."""
    path = tmp_path / "profile.json"
    save_profile(PROFILE, path)
    return policy(profile=str(path))


def test_images_go_to_the_least_loaded_encoder(pol: SloGoodput) -> None:
    v = view(
        worker("e_busy", Role.ENCODE, short_tokens=5000, short_requests=1),
        worker("e_idle", Role.ENCODE),
        worker("p", Role.PREFILL),
        worker("d", Role.DECODE),
    )
    plan = plan_of(pol.plan(request(PROMPT, image_tokens=200), v, 0.0))
    assert plan.encode_worker == "e_idle"
    # encode 0.005 + 200e-5 and the embeddings' link latency 0.001 (the prefill worker is
    # idle, so nothing overlaps it); prefill and transfer of 700 tokens.
    expected = 0.005 + 0.002 + 0.001 + prefill_s(700) + 700 * 1e5 / 1e9 + 0.001
    assert plan.predicted_ttft_s == pytest.approx(expected)


def test_images_are_encoded_on_the_prefill_worker_when_every_encoder_is_swamped(
    pol: SloGoodput,
) -> None:
    swamped = view(
        worker("e", Role.ENCODE, short_tokens=5000, short_requests=10),
        worker("p", Role.PREFILL),
        worker("d", Role.DECODE),
    )
    plan = plan_of(pol.plan(request(PROMPT, image_tokens=200), swamped, 0.0))
    assert plan.encode_worker is None  # 5000 queued tokens cost 50 ms > 2 x 7 ms encoding here
    expected = 0.005 + 0.002 + prefill_s(700) + 700 * 1e5 / 1e9 + 0.001
    assert plan.predicted_ttft_s == pytest.approx(expected)
    # The same encoder, behind a prefill queue longer than its own: the encode overlaps it.
    behind = view(
        worker("e", Role.ENCODE, short_tokens=5000, short_requests=10),
        worker("p", Role.PREFILL, short_tokens=2000, short_requests=4),
        worker("d", Role.DECODE),
    )
    plan = plan_of(pol.plan(request(PROMPT, image_tokens=200), behind, 0.0))
    assert plan.encode_worker == "e"


def test_a_request_s_images_are_split_over_encoders_when_that_lands_them_sooner(
    pol: SloGoodput,
) -> None:
    v = view(
        worker("e0", Role.ENCODE),
        worker("e1", Role.ENCODE),
        worker("e2", Role.ENCODE, short_tokens=1000, short_requests=1),
        worker("p", Role.PREFILL),
        worker("d", Role.DECODE),
    )
    four = replace(request(PROMPT, image_tokens=400), num_images=4)
    plan = plan_of(pol.plan(four, v, 0.0))
    # All on e0: 0.005 + 400e-5 + 1 ms = 10 ms; two images each on e0 and e1: 0.005 +
    # 200e-5 + 1 ms = 8 ms; three parts (2, 1, 1 images; e2 queues 10 ms): 18 ms.
    assert plan.encode_parts == (("e0", 0, 2), ("e1", 2, 4)) and plan.encode_worker == "e0"
    assert plan.encode_workers == ("e0", "e1")
    expected = 0.008 + prefill_s(900) + 900 * 1e5 / 1e9 + 0.001
    assert plan.predicted_ttft_s == pytest.approx(expected)
    # One image is never split.
    one = replace(request(PROMPT, image_tokens=400), num_images=1)
    plan = plan_of(pol.plan(one, v, 0.0))
    assert plan.encode_parts == () and plan.encode_worker == "e0"
    assert plan.encode_split(1) == (("e0", 0, 1),)


def test_images_of_different_sizes_are_split_by_their_tokens(pol: SloGoodput) -> None:
    v = view(
        worker("e0", Role.ENCODE),
        worker("e1", Role.ENCODE),
        worker("p", Role.PREFILL),
        worker("d", Role.DECODE),
    )
    four = replace(request(PROMPT, image_tokens=400), num_images=4, image_tokens=(250, 50, 50, 50))
    plan = plan_of(pol.plan(four, v, 0.0))
    # The large image alone on e0 (0.005 + 250e-5 + 1 ms = 8.5 ms) beside the three small
    # ones on e1 (7.5 ms); by count, the first two would take 9 ms; all on e0, 10 ms.
    assert plan.encode_parts == (("e0", 0, 1), ("e1", 1, 4))
    expected = 0.0085 + prefill_s(900) + 900 * 1e5 / 1e9 + 0.001
    assert plan.predicted_ttft_s == pytest.approx(expected)


def test_the_encode_term_is_fitted_from_observed_encodes(pol: SloGoodput) -> None:
    v = view(worker("p", Role.PREFILL), worker("d", Role.DECODE))
    before = plan_of(pol.plan(request(PROMPT, image_tokens=200), v, 0.0)).predicted_ttft_s
    for _ in range(8):
        pol.observe_encode("e", 200, 0.107)  # 0.1 s slower than the profile's 7 ms
    after = plan_of(pol.plan(request(PROMPT, image_tokens=200), v, 0.0)).predicted_ttft_s
    assert before is not None and after is not None
    assert after - before == pytest.approx(0.1, abs=1e-6)


def test_a_remote_encode_lands_behind_the_prompts_whose_images_land_first(
    pol: SloGoodput,
) -> None:
    """A prompt placed on ``p`` whose images are still on encode workers joins p's queue
    when they land: a text request placed now goes ahead of it, an image request encoded
    remotely too lands after it, behind its prefill (0.01 + 3000e-4 = 0.31 s)."""
    p = replace(worker("p", Role.PREFILL), encoding_requests=1, encoding_tokens=3000)
    v = view(worker("e", Role.ENCODE), p, worker("d", Role.DECODE))
    text = plan_of(pol.plan(request(PROMPT), v, 0.0))
    assert text.predicted_ttft_s == pytest.approx(prefill_s(PROMPT) + PROMPT * 1e5 / 1e9 + 0.001)
    image = plan_of(pol.plan(request(PROMPT, image_tokens=200), v, 0.0))
    assert image.encode_worker == "e"  # landed at 0.008 s, then behind the 0.31 s prefill
    expected = prefill_s(3000) + prefill_s(700) + 700 * 1e5 / 1e9 + 0.001
    assert image.predicted_ttft_s == pytest.approx(expected)
