"""``window_goodput``: the requests sent within a run's window that met the SLO, per
second of the window; neither a request sent after the window nor a late answer's drain
counts against it."""

from __future__ import annotations

from loadgen.metrics import GoodputSLO, RequestRecord
from loadgen.overload import window_goodput

SLO = GoodputSLO(ttft_ms=2000, tpot_ms=200)


def record(start_s: float, ttft_s: float, e2el_s: float, success: bool = True) -> RequestRecord:
    return RequestRecord("r", success, start_s, ttft_s, e2el_s, output_tokens=11)


def test_counts_good_requests_sent_in_the_window_per_second_of_it() -> None:
    records = [
        record(0.5, 0.1, 1.1),  # good
        record(9.9, 1.0, 3.0),  # good, answered long after the window: counts
        record(3.0, 2.5, 3.0),  # TTFT 2.5 s: missed
        record(4.0, 0.1, 3.1),  # TPOT 300 ms: missed
        record(5.0, 0.0, 0.01, success=False),  # refused
        record(10.0, 0.1, 1.1),  # sent after the window
    ]
    assert window_goodput(records, SLO, 10.0) == 2 / 10.0


def test_is_zero_with_nothing_good() -> None:
    assert window_goodput([record(1.0, 3.0, 4.0)], SLO, 5.0) == 0.0
