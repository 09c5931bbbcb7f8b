"""Per-key limits: token buckets for requests and tokens per minute, a concurrency cap."""

from __future__ import annotations

import pytest

from services.gateway.keys import KeyLimits
from services.gateway.limits import Admitted, Limited, RateLimiter


def test_requests_per_minute_refill_continuously() -> None:
    limiter, limits = RateLimiter(), KeyLimits(requests_per_minute=2)
    assert isinstance(limiter.admit("a", limits, 0, now_s=0.0), Admitted)
    assert isinstance(limiter.admit("a", limits, 0, now_s=0.0), Admitted)
    refused = limiter.admit("a", limits, 0, now_s=0.0)
    assert isinstance(refused, Limited) and refused.limit == "requests"
    assert refused.retry_after_s == pytest.approx(30.0)  # 2/min: one back every 30 s
    assert refused.status.remaining_requests == 0 and refused.status.limit_requests == 2
    assert isinstance(limiter.admit("a", limits, 0, now_s=29.0), Limited)
    assert isinstance(limiter.admit("a", limits, 0, now_s=30.5), Admitted)


def test_keys_are_limited_separately() -> None:
    limiter, limits = RateLimiter(), KeyLimits(requests_per_minute=1)
    assert isinstance(limiter.admit("a", limits, 0, 0.0), Admitted)
    assert isinstance(limiter.admit("a", limits, 0, 0.0), Limited)
    assert isinstance(limiter.admit("b", limits, 0, 0.0), Admitted)


def test_tokens_charged_up_front_and_unused_ones_given_back() -> None:
    limiter, limits = RateLimiter(), KeyLimits(tokens_per_minute=600)  # 10 tokens/s
    first = limiter.admit("a", limits, 400, 0.0)
    assert isinstance(first, Admitted) and first.status.remaining_tokens == 200
    refused = limiter.admit("a", limits, 400, 0.0)
    assert isinstance(refused, Limited) and refused.limit == "tokens"
    assert refused.retry_after_s == pytest.approx(20.0)
    limiter.finish(first, num_tokens_used=100, now_s=0.0)  # 300 given back
    again = limiter.admit("a", limits, 400, 0.0)
    assert isinstance(again, Admitted) and again.status.remaining_tokens == 100


def test_a_request_bigger_than_the_bucket_waits_for_a_full_one_and_leaves_debt() -> None:
    limiter, limits = RateLimiter(), KeyLimits(tokens_per_minute=60)  # 1 token/s
    big = limiter.admit("a", limits, 120, 0.0)
    assert isinstance(big, Admitted)
    limiter.finish(big, num_tokens_used=120, now_s=0.0)
    refused = limiter.admit("a", limits, 1, 0.0)
    assert isinstance(refused, Limited) and refused.retry_after_s == pytest.approx(61.0)


def test_concurrency_cap_frees_on_finish() -> None:
    limiter, limits = RateLimiter(), KeyLimits(max_concurrent_requests=1)
    first = limiter.admit("a", limits, 10, 0.0)
    assert isinstance(first, Admitted)
    refused = limiter.admit("a", limits, 10, 0.0)
    assert isinstance(refused, Limited) and refused.limit == "concurrency"
    limiter.finish(first, 10, 0.0)
    assert limiter.num_inflight("a") == 0
    assert isinstance(limiter.admit("a", limits, 10, 0.0), Admitted)


def test_a_refused_request_takes_nothing() -> None:
    limiter = RateLimiter()
    limits = KeyLimits(requests_per_minute=10, tokens_per_minute=100)
    assert isinstance(limiter.admit("a", limits, 1000, 0.0), Admitted)  # takes the full bucket
    refused = limiter.admit("a", limits, 50, 0.0)
    assert isinstance(refused, Limited) and refused.limit == "tokens"
    assert refused.status.remaining_requests == 9  # the refusal did not spend a request
