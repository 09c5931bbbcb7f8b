"""The simulator's encode stage, against timelines computed by hand.

A request with images is encoded on the plan's encode worker (FIFO there, then one
link latency for the embeddings) before it joins its prefill worker's queue, or, with
no encode worker, by its prefill worker in its first prefill step, where it also
holds up the requests queued behind it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.arrivals import RateSpec
from loadgen.sim import SimConfig, simulate_specs
from loadgen.workload import RequestSpec
from router.profile import EncodeCoeffs, TransferCoeffs
from tests.unit.loadgen.test_sim import PROFILE as TEXT_PROFILE

PROFILE = replace(TEXT_PROFILE, encode=EncodeCoeffs(a=0.02, b=0.001))
PER_IMAGE = 10  # image tokens per image


def _config(**kw: object) -> SimConfig:
    kw.setdefault("policy", "round_robin")
    return SimConfig(
        rate=RateSpec(1.0),
        profile=PROFILE,
        num_prefill=1,
        num_decode=1,
        image_tokens_per_image=PER_IMAGE,
        rebalance=False,
        **kw,  # type: ignore[arg-type]
    )


def _ttfts(config: SimConfig, specs: list[RequestSpec]) -> dict[str, float]:
    result = simulate_specs(config, specs)
    assert all(r.success for r in result.records)
    return {r.request_id: r.ttft_s for r in result.records if r.ttft_s is not None}


IMAGE = RequestSpec("img", 0.0, 80, 3, image_sides=(448, 448))  # 80 text + 20 image tokens
TEXT = RequestSpec("txt", 0.001, 50, 3)


def test_an_encode_worker_encodes_before_the_prefill_queue() -> None:
    ttft = _ttfts(_config(num_encode=1), [IMAGE])["img"]
    # encode 0.02 + 20 x 0.001, the embeddings' latency 0.005, prefill 0.01 + 100 x 0.001
    assert ttft == pytest.approx(0.04 + 0.005 + 0.11)


def test_without_an_encode_worker_the_prefill_worker_encodes_and_the_queue_waits() -> None:
    ttft = _ttfts(_config(), [IMAGE, TEXT])
    assert ttft["img"] == pytest.approx(0.04 + 0.11)
    # The text request arrived during that step: it waits for the encode and the prefill.
    assert ttft["txt"] == pytest.approx(0.15 - 0.001 + 0.01 + 50 * 0.001)


def test_with_an_encode_worker_a_text_request_is_not_held_up_by_an_encode() -> None:
    ttft = _ttfts(_config(num_encode=1), [IMAGE, TEXT])
    assert ttft["txt"] == pytest.approx(0.01 + 50 * 0.001)  # the prefill worker was idle
    colocated = _ttfts(_config(), [IMAGE, TEXT])
    assert ttft["txt"] < colocated["txt"]


def test_slo_goodput_uses_an_idle_encode_worker() -> None:
    ttft = _ttfts(_config(num_encode=1, policy="slo_goodput"), [IMAGE, TEXT])
    assert ttft["txt"] == pytest.approx(0.01 + 50 * 0.001)
    # Its embeddings land at 0.045, behind the text prefill (0.001 to 0.061): FIFO.
    assert ttft["img"] == pytest.approx(0.061 + 0.11)


def test_a_request_s_images_split_over_two_encode_workers_land_with_the_last_part() -> None:
    three = RequestSpec("three", 0.0, 70, 3, image_sides=(448, 448, 448))  # 70 + 30 tokens
    # round_robin spreads the three images over both encode workers: two on one, one
    # on the other, at once. The two-image part is the last to land: 0.02 + 20 x 0.001,
    # then the latency 0.005; then the prefill 0.01 + 100 x 0.001.
    split = _ttfts(_config(num_encode=2), [three])["three"]
    assert split == pytest.approx(0.04 + 0.005 + 0.11)
    whole = _ttfts(_config(num_encode=1), [three])["three"]  # 0.02 + 30 x 0.001 on one
    assert whole == pytest.approx(0.05 + 0.005 + 0.11)


def test_tiled_images_cost_their_tiles_and_each_part_its_own_images() -> None:
    # InternVL2-style tiles of 448 px: a 448 px image is one tile (10 tokens), a 900 px
    # one 2x2 tiles and a thumbnail (50 tokens).
    mixed = RequestSpec("mixed", 0.0, 40, 3, image_sides=(448, 900))  # 40 + 60 tokens
    tiled = _config(num_encode=1, image_tile_px=448)
    # One encoder: 0.02 + 60 x 0.001, the latency 0.005, the prefill 0.01 + 100 x 0.001.
    assert _ttfts(tiled, [mixed])["mixed"] == pytest.approx(0.08 + 0.005 + 0.11)
    # Split over two encoders, one image each: the 900 px image's part is the last to
    # land (0.02 + 50 x 0.001). Priced at the mean of 30 tokens an image it would have
    # landed at 0.05 + 0.005.
    split = _ttfts(replace(tiled, num_encode=2), [mixed])["mixed"]
    assert split == pytest.approx(0.07 + 0.005 + 0.11)
    # Three images over two encoders: the router cuts them by tokens, the 900 px image
    # alone (0.02 + 50 x 0.001) and the two small ones together (0.02 + 20 x 0.001).
    # Cut by count, the first part would have had two images: 0.02 + 60 x 0.001.
    three = RequestSpec("three", 0.0, 40, 3, image_sides=(900, 448, 448))  # 40 + 70 tokens
    cut = _ttfts(replace(tiled, num_encode=2), [three])["three"]
    assert cut == pytest.approx(0.07 + 0.005 + 0.12)
    # Without tiles every image is one fixed count, whatever its size.
    fixed = _ttfts(_config(num_encode=1), [mixed])["mixed"]  # 40 + 20 tokens
    assert fixed == pytest.approx(0.04 + 0.005 + 0.07)


def test_slo_goodput_prices_encodes_on_the_worker_that_encodes_them_as_they_run() -> None:
    """Encode colocated, each image request followed at once by a text one: the prefill
    worker's step that starts an image prompt also encodes its images, and the text
    request queued behind it waits for both. The router's TTFT predictions match the
    simulated TTFTs: the encodes inside a step are priced by the encode term, not fitted
    into the prefill curve (fitted in, an image prompt was priced an encode too slow),
    and the encode of a prompt queued ahead counts in the wait behind it. (A link of no
    cost: a disaggregated plan's TTFT also prices the KV transfer, which the first token,
    streamed by the prefill worker, does not wait for.)"""
    free_link = replace(PROFILE, transfer=TransferCoeffs(bandwidth_bytes_per_s=1e18, latency_s=0.0))
    specs = []
    for k in range(40):
        specs.append(replace(IMAGE, request_id=f"img{k}", arrival_s=k * 1.0))
        specs.append(replace(TEXT, request_id=f"txt{k}", arrival_s=k * 1.0 + 0.001))
    config = replace(_config(policy="slo_goodput"), profile=free_link)
    result = simulate_specs(config, specs)
    assert all(r.success for r in result.records)
    s = result.summary
    # Each pair: the image's TTFT 0.15 s (0.04 of it its encode), the text's 0.209.
    assert abs(s["ttft_pred_err_p50_ms"]) < 5.0, s
    assert s["ttft_pred_err_p90_ms"] < 5.0, s
