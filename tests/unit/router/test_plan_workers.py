"""``Plan.text_workers`` / ``Plan.workers``: the workers a plan runs on, which the
reservations, the gateway's unreserve and the router benchmark all walk."""

from __future__ import annotations

import pytest

from router.types import Plan


@pytest.mark.parametrize(
    ("plan", "text", "every"),
    [
        (Plan("p0", None), ("p0",), ("p0",)),
        (Plan("m0", "m0"), ("m0",), ("m0",)),  # colocated, named twice
        (Plan("p0", "d1"), ("p0", "d1"), ("p0", "d1")),
        (Plan("p0", "d1", encode_worker="e0"), ("p0", "d1"), ("p0", "d1", "e0")),
        (
            Plan("p0", None, "e1", encode_parts=(("e1", 0, 1), ("e0", 1, 2), ("e1", 2, 3))),
            ("p0",),
            ("p0", "e1", "e0"),
        ),
    ],
    ids=["colocated", "colocated_named", "disaggregated", "epd", "split_encode"],
)
def test_workers_in_first_event_order_without_repeats(
    plan: Plan, text: tuple[str, ...], every: tuple[str, ...]
) -> None:
    assert plan.text_workers == text
    assert plan.workers == every
