"""Length classes: knee default, bounded adaptation, per-class queue waits, spatial pools."""

from __future__ import annotations

import random

import pytest

from router.length import (
    LengthClassifier,
    LongPool,
    effective_prefill_tokens,
    long_pool_size,
    queue_wait_s,
)
from router.profile import QuadCoeffs
from router.types import LengthClass, RequestProfile, Role

FLAT_THEN_LINEAR = QuadCoeffs(a=0.02, b=1e-4, c=0.0)  # knee at 200 tokens


def test_default_threshold_is_the_knee_and_splits_there() -> None:
    cls = LengthClassifier(FLAT_THEN_LINEAR)
    assert cls.threshold_tokens == pytest.approx(200)
    assert cls.classify(199) is LengthClass.SHORT
    assert cls.classify(200) is LengthClass.LONG


def test_fixed_threshold_does_not_adapt() -> None:
    cls = LengthClassifier(FLAT_THEN_LINEAR, threshold_tokens=64)
    for _ in range(100):
        cls.observe(10_000)
    assert cls.threshold_tokens == 64


def test_threshold_tracks_the_quantile_of_traffic_within_bounds() -> None:
    rng = random.Random(0)
    cls = LengthClassifier(FLAT_THEN_LINEAR, quantile=0.8, step=0.02)
    # Uniform 1..500: the 0.8 quantile is 400, inside [50, 800].
    for _ in range(20_000):
        cls.observe(rng.randint(1, 500))
    assert cls.threshold_tokens == pytest.approx(400, rel=0.1)
    # All-short traffic pulls θ down, but never below knee / 4.
    for _ in range(5_000):
        cls.observe(5)
    assert cls.threshold_tokens == pytest.approx(50)
    # All-long traffic: never above knee × 4.
    for _ in range(5_000):
        cls.observe(100_000)
    assert cls.threshold_tokens == pytest.approx(800)


def test_effective_length_subtracts_the_prefix_hit_and_adds_images() -> None:
    p = RequestProfile(
        "r", num_prompt_tokens=1000, num_new_tokens=300, max_tokens=8, num_image_tokens=50
    )
    assert effective_prefill_tokens(p) == 350  # the gateway's predicted hit
    assert effective_prefill_tokens(p, hit_tokens=960) == 90  # a worker's own hit
    assert effective_prefill_tokens(p, hit_tokens=5000) == 1  # never nothing to compute


def test_a_queue_is_served_first_come_first_served_without_a_long_prefill_threshold() -> None:
    # The engine has one queue: a short request waits for the long prompt ahead of it.
    tokens = {LengthClass.SHORT: 100, LengthClass.LONG: 8000}
    counts = {LengthClass.SHORT: 2, LengthClass.LONG: 1}
    everything = 2 * 0.02 + 1e-4 * 100 + 0.02 + 1e-4 * 8000
    q = FLAT_THEN_LINEAR
    for cls in LengthClass:
        assert queue_wait_s(q, tokens, counts, cls) == pytest.approx(everything)


def test_with_a_long_prefill_threshold_a_short_request_waits_for_one_chunk_of_each_long() -> None:
    # Two 4000-token prompts and two short ones queued; the engine caps a request at 512
    # tokens a step while others wait, so a short arrival shares its first step with the
    # short work and one 512-token chunk of each long prompt (1124 tokens, 1 step of 2048).
    q = QuadCoeffs(a=0.02, b=1e-4, c=1e-8)
    tokens = {LengthClass.SHORT: 100, LengthClass.LONG: 8000}
    counts = {LengthClass.SHORT: 2, LengthClass.LONG: 2}
    short = queue_wait_s(q, tokens, counts, LengthClass.SHORT, 2048, long_prefill_tokens=512)
    assert short == pytest.approx(q.a + q.b * 1124 + q.c * (100**2 / 2 + 2 * 512**2))
    # A long arrival still waits for everything (the queue's own prompts run first).
    fcfs = queue_wait_s(q, tokens, counts, LengthClass.SHORT, 2048)
    assert queue_wait_s(q, tokens, counts, LengthClass.LONG, 2048, 512) == pytest.approx(fcfs)
    assert fcfs == pytest.approx(
        q.a + q.b * 100 + q.c * 100**2 / 2 + 4 * q.a + q.b * 8000 + q.c * 8000**2 / 2
    )
    assert short < fcfs / 4
    # A threshold at or above every long prompt chunks nothing: first come, first served.
    assert queue_wait_s(q, tokens, counts, LengthClass.SHORT, 2048, 4000) == pytest.approx(fcfs)
    # Unknown budget: each request and each chunk its own step.
    unknown = queue_wait_s(q, tokens, counts, LengthClass.SHORT, 0, 512)
    assert unknown == pytest.approx(4 * q.a + q.b * 1124 + q.c * (100**2 / 2 + 2 * 512**2))


def test_long_pool_takes_prefill_workers_first_then_mixed_ones() -> None:
    from tests.unit.router.builders import worker

    workers = [worker(w, Role.PREFILL) for w in ("p1", "p0", "p2")]
    workers += [worker("m1", Role.MIXED), worker("d", Role.DECODE), worker("m0", Role.MIXED)]
    pool = LongPool()
    pool.order(workers)

    def members(size: int) -> set[str]:
        pool.size = size
        in_pool, everyone = pool.members()
        assert everyone == (size >= 5)
        return {w.worker_id for w, x in zip(workers, in_pool, strict=True) if x}

    assert members(2) == {"p1", "p2"}  # by sorted id, from the last
    assert members(4) == {"p0", "p1", "p2", "m1"}
    assert members(9) == {"p0", "p1", "p2", "m0", "m1"} and pool.size == 5
    assert members(0) == set()


def test_long_pool_size_follows_the_share_and_holds_near_a_boundary() -> None:
    assert long_pool_size(1.0, (0.0, 1.0), 2, current=1) == 2  # only long work: every host
    assert long_pool_size(0.0, (1.0, 0.0), 4, current=1) == 0  # no long work: no pool
    assert long_pool_size(0.66, (0.8, 0.2), 10, current=2) == 7
    # Within 0.75 of the target the size stands (target 1.6 from 1; 1.3 from 2) ...
    assert long_pool_size(0.8, (0.5, 0.5), 2, current=1) == 1
    assert long_pool_size(0.65, (0.0, 1.0), 2, current=2) == 2
    # ... past it, it moves to the rounded target; never past the hosts there are.
    assert long_pool_size(0.9, (0.0, 1.0), 2, current=1) == 2
    assert long_pool_size(0.5, (0.5, 0.5), 3, current=5) == 2
    assert long_pool_size(0.25, (0.9, 0.1), 2, current=None) == 1  # the first size: rounded
    # A large pool holds within 5% of the hosts: 256 hosts, 12.8 workers either way.
    assert long_pool_size(0.27, (0.8, 0.2), 256, current=64) == 64
    assert long_pool_size(0.31, (0.8, 0.2), 256, current=64) == 79


def test_a_class_that_brings_requests_keeps_a_worker_of_its_own() -> None:
    # 45% of requests are long and carry 95% of the work: the short ones keep one.
    assert long_pool_size(0.95, (0.55, 0.45), 2, current=None) == 1
    assert long_pool_size(0.95, (0.55, 0.45), 8, current=None) == 7
    # 20% long carrying 4% of the work: the long ones keep one (never colocated).
    assert long_pool_size(0.04, (0.8, 0.2), 4, current=None) == 1
    assert long_pool_size(0.04, (0.8, 0.2), 1, current=None) == 1
    # Under MIN_CLASS_SHARE of the requests, a class keeps nothing of its own.
    assert long_pool_size(0.99, (0.01, 0.99), 2, current=None) == 2
    assert long_pool_size(0.01, (0.99, 0.01), 2, current=None) == 0


def test_long_share_is_the_long_class_share_of_recent_prefill_work() -> None:
    cls = LengthClassifier(FLAT_THEN_LINEAR, threshold_tokens=200, share_window=50)
    assert cls.long_share == pytest.approx(0.25)  # the prior before any request
    assert cls.long_request_share == pytest.approx(0.25)
    for _ in range(200):  # nine 100-token prompts (0.03 s each), one of 1800 (0.2 s)
        for _ in range(9):
            cls.observe(100)
        cls.observe(1800)
    # Weighted by work, not by count: 0.2 / (0.2 + 9 x 0.03), within the decay's tilt.
    assert cls.long_share == pytest.approx(0.2 / 0.47, abs=0.03)
    assert cls.long_request_share == pytest.approx(0.1, abs=0.03)
    for _ in range(300):  # the traffic turns long: the share follows within a few windows
        cls.observe(1800)
    assert cls.long_share > 0.99 and cls.long_request_share > 0.99


def test_batched_prefill_pays_the_fixed_overhead_once_per_step() -> None:
    # 40 short prompts of 50 tokens: an engine with a 1024-token step budget runs
    # them in 2 steps, so the queue costs 2·a, not 40·a.
    q = FLAT_THEN_LINEAR
    tokens, counts = {LengthClass.SHORT: 2000}, {LengthClass.SHORT: 40}
    per_request = queue_wait_s(q, tokens, counts, LengthClass.SHORT)
    batched = queue_wait_s(q, tokens, counts, LengthClass.SHORT, 1024)
    assert per_request == pytest.approx(40 * q.a + q.b * 2000 + q.c * 2000**2 / 40)
    assert batched == pytest.approx(2 * q.a + q.b * 2000 + q.c * 2000**2 / 40)
    # A budget smaller than the prompts cannot make it cheaper than one step per request:
    # the engine chunks them, 2000 tokens in 512-token steps are 4 steps, not 2.
    few = {LengthClass.SHORT: 2}
    chunked = queue_wait_s(q, tokens, few, LengthClass.SHORT, 512)
    assert chunked >= queue_wait_s(q, tokens, few, LengthClass.SHORT)
    assert chunked == pytest.approx(4 * q.a + q.b * 2000 + q.c * 2000**2 / 2)


def test_a_class_not_seen_for_ten_of_its_gaps_is_gone() -> None:
    cls = LengthClassifier(FLAT_THEN_LINEAR, threshold_tokens=200)
    for _ in range(100):
        cls.observe(100)
    assert cls.present_request_shares[0] > 0.99
    longs = 0
    while cls.present_request_shares[0] > 0.0:  # long prompts only from here
        cls.observe(1800)
        longs += 1
    assert longs <= 11 and cls.long_request_share < 0.7  # its decayed share is still large
    # Gone, it keeps no worker and has no work: the pool takes every host at once.
    assert long_pool_size(cls.long_share, cls.present_request_shares, 2, current=1) == 2
    cls.observe(100)  # short prompts again: present, with the share they had
    assert cls.present_request_shares[0] > 0.5
    assert long_pool_size(cls.long_share, cls.present_request_shares, 2, current=2) == 1


def test_a_class_still_coming_is_seldom_judged_gone() -> None:
    """A steady 5% long class: its request arrives after ten of its mean gaps about
    e^-10 of the time, more for the noise of the share it is judged by (measured: 0.9%;
    at 6 gaps, 5%, and a 45%/55% mix saw a class judged gone in a quarter of 600-request
    runs, enough to break the spatial split live)."""
    cls = LengthClassifier(FLAT_THEN_LINEAR, threshold_tokens=200)
    rng = random.Random(0)
    arrivals = arrived_gone = 0
    for _ in range(20000):
        long = rng.random() < 0.05
        if long:
            arrivals += 1
            arrived_gone += cls.present_request_shares[1] == 0.0
        cls.observe(1800 if long else 100)
    assert 0 < arrived_gone / arrivals < 0.02
