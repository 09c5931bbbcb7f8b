"""router.links.LinkFit: latency and bandwidth fitted from measured transfers."""

from __future__ import annotations

import pytest

from router.links import LinkFit, Links
from router.profile import TransferCoeffs

SEED = TransferCoeffs(bandwidth_bytes_per_s=1e9, latency_s=0.001)


def test_sizes_that_differ_fit_both_latency_and_bandwidth() -> None:
    fit = LinkFit(SEED)
    for num_bytes in (1e6, 5e6, 2e6, 9e6, 3e6):  # 4 ms + bytes / 250 MB/s
        fit.observe(int(num_bytes), 0.004 + num_bytes / 250e6)
    assert fit.estimate.bandwidth_bytes_per_s == pytest.approx(250e6)
    assert fit.estimate.latency_s == pytest.approx(0.004)


def test_one_size_keeps_the_seed_latency_and_measures_bandwidth() -> None:
    fit = LinkFit(SEED)
    assert fit.estimate == SEED
    for _ in range(5):
        fit.observe(4_000_000, 0.001 + 4e6 / 100e6)  # 100 MB/s after the seed's 1 ms
    assert fit.estimate.latency_s == SEED.latency_s
    assert fit.estimate.bandwidth_bytes_per_s == pytest.approx(100e6)


def test_only_the_window_counts() -> None:
    fit = LinkFit(SEED, window=4)
    for _ in range(4):
        fit.observe(1_000_000, 0.001 + 1e6 / 1e6)  # a slow link (1 MB/s) ...
    for _ in range(4):
        fit.observe(1_000_000, 0.001 + 1e6 / 1e8)  # ... that recovered
    assert fit.estimate.bandwidth_bytes_per_s == pytest.approx(1e8)


def test_small_transfers_measure_latency_not_bandwidth() -> None:
    # The tiny model's 16-token pull (8 KB) took 0.2 s, its first connection included: the
    # seed moves 8 KB in 8 us, far under its 1 ms latency, so the 0.2 s is fixed cost. As
    # bandwidth (40 KB/s) it priced a 256-token pull at 3.2 s, past a 2 s TTFT target.
    fit = LinkFit(SEED)
    fit.observe(8192, 0.2)
    assert fit.estimate.bandwidth_bytes_per_s == SEED.bandwidth_bytes_per_s
    assert fit.estimate.latency_s == pytest.approx(0.2 - 8192 / 1e9)
    for _ in range(3):
        fit.observe(8192, 0.01)
    assert fit.estimate.latency_s == pytest.approx((0.2 + 3 * 0.01) / 4 - 8192 / 1e9)


def test_the_view_is_shown_a_link_only_when_it_moved_past_the_tolerance() -> None:
    """``Links``: each transfer refits the worker's link, but what the view shows (and
    so the rows rebuilt) changes only on the first transfer and when the fit moved by
    more than 5%; ``estimate`` always follows the fit."""
    seed = TransferCoeffs(bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    links = Links(seed)
    assert links.shown("w") is None and links.estimate("w") == seed
    assert links.observe("w", 10**8, 0.101)  # first: shown
    first = links.shown("w")
    assert first is not None
    assert not links.observe("w", 10**8, 0.102)  # 1% slower: the view keeps its figures
    assert links.shown("w") == first and links.estimate("w") != first
    assert links.observe("w", 10**8, 0.150)  # far slower: shown
    shown = links.shown("w")
    assert shown is not None and shown.bandwidth_bytes_per_s < 0.95 * first.bandwidth_bytes_per_s
    links.forget("w")
    assert links.shown("w") is None and links.estimate("w") == seed
