"""Image requests in the load harness: counts and sizes drawn from distributions, generated
PNGs sent as data: URLs in chat content, reproducible and never repeated."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from loadgen.client import _payload
from loadgen.scenario import WorkloadConfig, build_requests
from loadgen.workload import WorkloadError


def _decoded(part: dict[str, object]) -> Image.Image:
    url = part["image_url"]["url"]  # type: ignore[index]
    header, _, data = url.partition(",")
    assert header == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_counts_and_sizes_follow_their_distributions() -> None:
    cfg = WorkloadConfig(
        num_requests=200, images_per_request="uniform:1-3", image_size="uniform:32-64", seed=3
    )
    specs = build_requests(cfg, None)
    counts = [len(s.image_sides) for s in specs]
    assert set(counts) == {1, 2, 3}
    sides = [side for s in specs for side in s.image_sides]
    assert min(sides) >= 32 and max(sides) <= 64 and len(set(sides)) > 10
    assert build_requests(cfg, None) == specs  # reproducible


def test_a_fraction_of_requests_carries_images() -> None:
    cfg = WorkloadConfig(num_requests=400, images_per_request="2", image_fraction=0.25)
    with_images = sum(bool(s.image_sides) for s in build_requests(cfg, None))
    assert 60 < with_images < 140
    assert not any(s.image_sides for s in build_requests(WorkloadConfig(num_requests=20), None))
    with pytest.raises(WorkloadError, match="image_fraction"):
        build_requests(WorkloadConfig(images_per_request="1", image_fraction=1.5), None)


def test_chat_payload_carries_generated_pngs_of_the_drawn_sizes() -> None:
    cfg = WorkloadConfig(num_requests=4, images_per_request="2", image_size="uniform:20-90")
    spec = build_requests(cfg, None)[0]
    body = _payload("chat", "tiny-vl", spec)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    images = [_decoded(p) for p in parts[:2]]
    assert [im.size for im in images] == [(s, s) for s in spec.image_sides]
    assert images[0].tobytes() != images[1].tobytes()  # no two images repeat
    text_only = build_requests(WorkloadConfig(num_requests=1), None)[0]
    assert isinstance(_payload("chat", "tiny", text_only)["messages"][0]["content"], str)
