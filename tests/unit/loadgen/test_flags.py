"""The argparse types the load tools check their numbers with (``loadgen/flags.py``)."""

from __future__ import annotations

import argparse

import pytest

from loadgen.flags import above_zero, at_least_zero, counts


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "abc", ""])
def test_above_zero_refuses_zero_and_anything_not_a_finite_positive_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"want seconds above 0, got {text!r}"):
        above_zero("seconds")(text)


@pytest.mark.parametrize("text", ["-0.1", "nan", "inf", "abc"])
def test_at_least_zero_refuses_negatives_and_anything_not_finite(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"want seconds, 0 or more; got {text!r}"):
        at_least_zero("seconds")(text)


def test_the_numbers_they_take() -> None:
    assert above_zero("s")("0.25") == 0.25
    assert at_least_zero("s")("0") == 0.0 and at_least_zero("s")("2.5") == 2.5
    assert counts("batch sizes", 2, "a slope")("1, 4,4") == [1, 4, 4]
    assert counts("repeats", 1, "", single=True)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 2 different batch sizes"):
        counts("batch sizes", 2, "a slope")("4,4")
