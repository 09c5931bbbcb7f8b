"""Summary arithmetic against values computed by hand on a small recorded run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.metrics import GoodputSLO, RequestRecord, compute_summary, parse_goodput
from loadgen.workload import WorkloadError

RECORDS = [
    # 5 tokens: TPOT (0.5-0.1)/4 = 100 ms
    RequestRecord("r1", True, 0.0, 0.1, 0.5, (0.1, 0.1, 0.1, 0.1), 10, 5),
    # 1 token: TPOT 0 for goodput, left out of TPOT statistics
    RequestRecord("r2", True, 0.1, 0.2, 0.2, (), 20, 1),
    # 3 tokens: TPOT (1.3-0.3)/2 = 500 ms
    RequestRecord("r3", True, 0.2, 0.3, 1.3, (0.5, 0.5), 30, 3),
    RequestRecord("r4", False, 0.3, None, None, (), 0, 0, 500, "boom"),
]


def test_throughputs_and_latency_stats() -> None:
    s = compute_summary(RECORDS, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx((60 + 9) / 2)
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert s["p90_ttft_ms"] == pytest.approx(280)  # linear between 200 and 300
    assert s["p99_ttft_ms"] == pytest.approx(298)
    assert s["mean_tpot_ms"] == pytest.approx(300)
    assert s["p90_tpot_ms"] == pytest.approx(460)
    assert s["mean_itl_ms"] == pytest.approx(1400 / 6)
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert s["request_goodput"] is None and s["slo_attainment"] is None


def test_goodput_every_target_must_hold() -> None:
    s = compute_summary(RECORDS, 2.0, GoodputSLO(ttft_ms=250, tpot_ms=200))
    # r1 good, r2 good (1 token: TPOT 0), r3 TTFT 300 > 250, r4 failed
    assert s["request_goodput"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(0.5)
    # Targets are inclusive: r2's e2el is exactly 200 ms.
    s = compute_summary(RECORDS, 2.0, GoodputSLO(e2el_ms=200))
    assert s["request_goodput"] == pytest.approx(0.5)
    s = compute_summary(RECORDS, 2.0, GoodputSLO(tpot_ms=50))
    assert s["request_goodput"] == pytest.approx(0.5)  # only r2 (TPOT 0)


def test_failed_never_count_even_with_loose_slo() -> None:
    s = compute_summary(RECORDS, 1.0, GoodputSLO(ttft_ms=1e9, tpot_ms=1e9, e2el_ms=1e9))
    assert s["request_goodput"] == pytest.approx(3.0)
    assert s["slo_attainment"] == pytest.approx(0.75)


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:200", "tpot:50"]) == GoodputSLO(200.0, 50.0, None)
    assert parse_goodput(["e2el:1000"]) == GoodputSLO(None, None, 1000.0)
    assert parse_goodput([]) is None
    with pytest.raises(WorkloadError, match="KEY:MS"):
        parse_goodput(["latency:3"])


def test_weighted_itl_override() -> None:
    values = np.array([0.01, 0.03])
    weights = np.array([3.0, 1.0])
    s = compute_summary(RECORDS, 1.0, itl_override=(values, weights))
    assert s["mean_itl_ms"] == pytest.approx(15.0)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    assert s["p90_itl_ms"] == pytest.approx(30.0)


def test_empty_run_is_zeros() -> None:
    s = compute_summary([], 1.0, GoodputSLO(ttft_ms=1))
    assert s["completed"] == 0 and s["mean_ttft_ms"] == 0.0 and s["slo_attainment"] == 0.0


def test_refusals_are_counted_with_how_fast_they_were_answered() -> None:
    records = [
        RequestRecord("ok", True, 0.0, ttft_s=0.1, e2el_s=0.5, output_tokens=4, status=200),
        RequestRecord("busy", False, 0.1, e2el_s=0.02, status=429),
        RequestRecord("down", False, 0.2, e2el_s=0.04, status=503),
        RequestRecord("bad", False, 0.3, e2el_s=0.01, status=400),  # a client error, no refusal
        RequestRecord("lost", False, 0.4, status=None),  # no answer at all
    ]
    out = compute_summary(records, 1.0)
    assert out["rejected"] == 2 and out["failed"] == 4
    assert out["max_rejection_ms"] == pytest.approx(40.0)
    assert 20.0 < out["p99_rejection_ms"] <= 40.0
    # The printed table tells refusals from breakage, under the failures.
    from loadgen.report import format_table

    lines = format_table(out).splitlines()
    names = [line.split()[0] for line in lines[1:]]
    assert names[:4] == ["completed", "failed", "rejected", "p99_rejection_ms"]
    assert lines[3].split() == ["rejected", "2"]
    # Every number has its unit: in the key (``_ms``) or beside it.
    rows = {line.rsplit(None, 1)[0].strip(): line.split()[-1] for line in lines[1:]}
    assert rows["duration (s)"] == "1.00" and "request_throughput (req/s)" in rows
    assert "output_throughput (tok/s)" in rows and "mean_ttft_ms" in rows


def test_a_scaled_slo_multiplies_every_set_target_and_leaves_the_rest_unset() -> None:
    slo = GoodputSLO(ttft_ms=2000, tpot_ms=200).scaled(2.5)
    assert slo == GoodputSLO(ttft_ms=5000, tpot_ms=500, e2el_ms=None)
    assert GoodputSLO(e2el_ms=100).scaled(3.0) == GoodputSLO(e2el_ms=300)
