"""The past-future estimator (after LightLLM): will a decode worker run out of KV memory?

For running requests ``i`` holding ``c_i`` KV tokens, having generated ``g_i`` of at
most ``M_i`` tokens:

1. ``H`` is a window of the output lengths of recently finished requests, seeded
   with a pessimistic prior that washes out as real lengths arrive.
2. Each request's final length ``L̂_i`` is drawn from ``H`` conditioned on
   ``L > g_i`` by inverse-CDF sampling with linear interpolation between the
   sorted conditional entries (one entry: that entry), capped by ``M_i``. A
   request that has outrun all of ``H`` is drawn uniformly between ``g_i`` and
   ``M_i``: nothing but its cap bounds it. Its remaining length is
   ``r_i = max(0, L̂_i − g_i − 1)``.
3. With ``r`` sorted descending, the peak future KV is
   ``max_k (k·r_(k) + Σ_{j≤k} c_(j))``: at step ``t = r_(k)`` exactly the ``k``
   longest-remaining requests are alive, each grown by ``t``; between finish
   events memory grows linearly, so the finish points are the only candidates.
4. ``S`` independent draws; the estimate is the largest peak (a cheap upper
   quantile).

A candidate is admitted only if the peak with it added stays under
``fraction × capacity`` (minus KV held by anything that is not a running
request). A candidate is a request with ``g = 0`` holding its prompt.

``PastFutureAdmission`` is this rule shaped as the engine's ``AdmissionPolicy``
(``services/backends/protocol.py``), matched structurally; it draws nothing when even
the worst case fits (``worst_case_peak``: every request at its cap), which bounds every
draw's peak, so the decision is the draws' own. ``router.peak_table``
keeps one worker's sorted draws so the router can price many candidates against it
in O(S·n) without redrawing.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from router.peak_table import PeakTable

__all__ = [
    "OutputLengthHistory",
    "PastFutureAdmission",
    "PastFutureEstimator",
    "RunningLike",
    "remaining_tokens",
    "sample_output_lengths",
    "sample_output_lengths_of_one",
    "sorted_history",
    "worst_case_peak",
]


class RunningLike(Protocol):
    """Anything shaped like a running request (router's RunningRequest, engine's stats)."""

    @property
    def num_tokens_held(self) -> int: ...

    @property
    def num_generated(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


class OutputLengthHistory:
    """``H``: the last ``window`` finished output lengths, seeded with ``num_prior``
    copies of ``prior_output_len``; the prior is pushed out by real lengths."""

    def __init__(
        self,
        prior_output_len: int,
        window: int = 200,
        num_prior: int = 100,
        lengths: Iterable[int] = (),
    ) -> None:
        if window < 1 or not 0 <= num_prior <= window:
            raise ValueError("need window >= 1 and 0 <= num_prior <= window")
        self._lengths: deque[int] = deque([int(prior_output_len)] * num_prior, maxlen=window)
        self._lengths.extend(int(v) for v in lengths)
        self._sorted: np.ndarray | None = None
        self.version = 0

    def observe(self, output_len: int) -> None:
        self._lengths.append(int(output_len))
        self._sorted = None
        self.version += 1

    def __len__(self) -> int:
        return len(self._lengths)

    def sorted_lengths(self) -> np.ndarray:
        if self._sorted is None:
            self._sorted = np.sort(np.fromiter(self._lengths, dtype=np.float64))
        return self._sorted


def sorted_history(
    prior_output_len: int, window: int, num_prior: int, lengths: Sequence[int]
) -> np.ndarray:
    """``OutputLengthHistory(prior_output_len, window, num_prior, lengths)``'s window,
    sorted, built at once from the lengths (for an owner that keeps them itself and
    rebuilds ``H`` when they change): the last ``window`` of ``num_prior`` priors
    followed by the lengths."""
    recent = np.fromiter(lengths[-window:], np.float64)
    num_prior = max(0, min(num_prior, window - len(recent)))
    kept = np.concatenate((np.full(num_prior, float(prior_output_len)), recent))
    return np.sort(kept)


def sample_output_lengths(
    sorted_lengths: np.ndarray,
    num_generated: np.ndarray,
    max_tokens: np.ndarray,
    u: np.ndarray,
) -> np.ndarray:
    """``L̂`` for each draw and request: ``u`` has shape (S, n) with values in [0, 1).

    The entries of sorted ``H`` longer than ``g`` are ``H[lo:]``; position
    ``lo + u·(count − 1)`` in ``H``, interpolated linearly between neighbours, is
    the inverse CDF of that conditional set (one entry: that entry)."""
    g = np.asarray(num_generated, dtype=np.float64)
    cap = np.maximum(np.asarray(max_tokens, dtype=np.float64), g)
    m = len(sorted_lengths)
    lo = sorted_lengths.searchsorted(g, side="right")  # first entry longer than g
    count = m - lo
    if m == 0 or count.min(initial=1) == 0:
        tail = g + u * (cap - g)  # outran all of H: only the cap bounds it
        if m == 0:
            return tail
    else:
        tail = None
    pos = lo + u * np.maximum(count - 1, 0)
    drawn = _interp_unit(pos, sorted_lengths)
    if tail is not None:
        drawn = np.where(count > 0, drawn, tail)
    return np.minimum(drawn, cap)


def sample_output_lengths_of_one(
    sorted_lengths: list[float], num_generated: float, max_tokens: float, u: list[float]
) -> list[float]:
    """``sample_output_lengths`` for one request, a draw per ``u``, in Python floats: the
    same operations on the same doubles, so the same values (``sorted_lengths`` is
    sorted ``H`` as a list). For a few draws of one request a numpy call per operation
    costs more than the arithmetic."""
    g = num_generated
    cap = max(max_tokens, g)
    m = len(sorted_lengths)
    lo = bisect_right(sorted_lengths, g)  # first entry longer than g
    count = m - lo
    out = []
    for x in u:
        if m == 0 or count == 0:  # outran all of H: only the cap bounds it
            drawn = min(g + x * (cap - g), cap)
        else:
            pos = lo + x * max(count - 1, 0)
            if m == 1:
                drawn = sorted_lengths[0]
            else:
                j = min(int(pos), m - 2)
                base = sorted_lengths[j]
                drawn = base + (pos - j) * (sorted_lengths[j + 1] - base)
            drawn = min(drawn, cap)
        out.append(drawn)
    return out


def _interp_unit(pos: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``np.interp(pos, arange(m), values)`` for ``0 <= pos`` (beyond ``m − 1``: any
    finite value, the caller replaces it): ``v[j] + (pos − j)·(v[j+1] − v[j])``, the
    same operations ``np.interp`` performs, without its per-point binary search."""
    m = len(values)
    if m == 1:
        return np.full(pos.shape, values[0])
    # The cell's left end as a float and as an index: ``pos − j`` then subtracts two
    # floats (the same value as with the integer ``j``, without converting it).
    left = np.minimum(np.floor(pos), m - 2)
    j = left.astype(np.intp)
    base = values.take(j)
    out: np.ndarray = values[1:].take(j)
    out -= base
    out *= pos - left
    out += base
    return out


def remaining_tokens(
    sorted_lengths: np.ndarray,
    num_generated: np.ndarray,
    max_tokens: np.ndarray,
    u: np.ndarray,
) -> np.ndarray:
    """``r = max(0, L̂ − g − 1)`` for each draw and request."""
    drawn = sample_output_lengths(sorted_lengths, num_generated, max_tokens, u)
    drawn -= num_generated  # a new array of its own: worked on in place
    drawn -= 1.0
    return np.maximum(drawn, 0.0, out=drawn)


def worst_case_peak(
    held_tokens: float,
    num_generated: np.ndarray,
    max_tokens: np.ndarray,
    candidate_prompt_tokens: int,
    candidate_max_tokens: int,
) -> float:
    """An upper bound of every draw's peak with a candidate added: each request's draw
    is capped by ``M``, so ``r_i <= max(0, M_i − g_i − 1)``, and with ``r`` sorted
    descending ``k·r_(k) <= Σ_{j≤k} r_(j)``, so each term of the peak is at most
    ``Σ_i (c_i + r_i)``. ``held_tokens``: ``Σ c_i`` of the running requests."""
    to_go = max_tokens - num_generated
    to_go -= 1.0
    running_to_go = float(np.maximum(to_go, 0.0, out=to_go).sum())
    candidate_to_go = max(0, candidate_max_tokens - 1)
    return held_tokens + running_to_go + candidate_prompt_tokens + candidate_to_go


def _arrays(running: Sequence[RunningLike]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(running)
    held = np.fromiter((r.num_tokens_held for r in running), dtype=np.float64, count=n)
    gen = np.fromiter((r.num_generated for r in running), dtype=np.float64, count=n)
    cap = np.fromiter((r.max_tokens for r in running), dtype=np.float64, count=n)
    return held, gen, cap


class PastFutureEstimator:
    """Peak future KV tokens of a set of running requests, with and without a candidate."""

    def __init__(
        self,
        history: OutputLengthHistory,
        rng: np.random.Generator,
        num_draws: int = 5,
        fraction: float = 0.95,
    ) -> None:
        if num_draws < 1 or not 0 < fraction <= 1:
            raise ValueError("need num_draws >= 1 and 0 < fraction <= 1")
        self.history = history
        self.rng = rng
        self.num_draws = num_draws
        self.fraction = fraction

    def table(self, running: Sequence[RunningLike]) -> PeakTable:
        return self.table_of(*_arrays(running))

    def table_of(self, held: np.ndarray, gen: np.ndarray, cap: np.ndarray) -> PeakTable:
        """``table`` for running requests given as arrays (c, g, M), one entry each."""
        u = self.rng.random((self.num_draws, len(held)))
        r = remaining_tokens(self.history.sorted_lengths(), gen, cap, u)
        return PeakTable(r, held)

    def candidate_remaining(self, max_tokens: int) -> np.ndarray:
        """``r_q`` for each draw of a request that has generated nothing yet."""
        u = self.rng.random((self.num_draws, 1))
        zero = np.zeros(1)
        cap = np.array([float(max_tokens)])
        return remaining_tokens(self.history.sorted_lengths(), zero, cap, u)[:, 0]

    def peak(self, running: Sequence[RunningLike]) -> float:
        return self.table(running).peak_tokens

    def peak_with(
        self, running: Sequence[RunningLike], num_prompt_tokens: int, max_tokens: int
    ) -> float:
        """Draws for ``running`` first, then the candidate's: with the same seed the
        running requests' draws equal those of ``peak(running)``."""
        table = self.table(running)
        return table.peak_with(float(num_prompt_tokens), self.candidate_remaining(max_tokens))

    def admit(
        self,
        running: Sequence[RunningLike],
        num_prompt_tokens: int,
        max_tokens: int,
        capacity_tokens: float,
        other_tokens: float = 0.0,
    ) -> bool:
        limit = self.fraction * capacity_tokens - other_tokens
        return self.peak_with(running, num_prompt_tokens, max_tokens) < limit


class PastFutureAdmission:
    """The estimator as the engine's admission rule (``AdmissionPolicy``, structurally).

    KV held by blocks that belong to no running request (held prefills, cached
    prefixes) is subtracted from the budget. ``record_exhaustion`` is called by the
    engine when memory ran out anyway (a misprediction).
    """

    def __init__(
        self,
        prior_output_len: int,
        fraction: float = 0.95,
        num_draws: int = 5,
        window: int = 200,
        num_prior: int = 100,
        seed: int = 0,
    ) -> None:
        self.history = OutputLengthHistory(prior_output_len, window=window, num_prior=num_prior)
        self.estimator = PastFutureEstimator(
            self.history, np.random.default_rng(seed), num_draws=num_draws, fraction=fraction
        )
        self.num_mispredictions = 0
        self.last_peak_tokens = 0.0  # the most recent estimate, for metrics

    def can_admit(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: Sequence[RunningLike],
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        rows = np.column_stack(_arrays(running)) if running else np.empty((0, 3))
        return self.can_admit_arrays(
            num_prompt_tokens, max_tokens, rows, num_free_blocks, num_total_blocks, block_size
        )

    def can_admit_arrays(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: np.ndarray,
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        """``can_admit`` with the running requests as an (n, 3) array of rows
        (c, g, M): the same decision and the same random draws, without building
        one object per running request (the simulator's engines call this)."""
        if math.ceil((num_prompt_tokens + 1) / block_size) > num_free_blocks:
            return False
        if not len(running):
            # Nothing to protect: waiting cannot make room, so refusing would only stall.
            return True
        held, gen, cap = running[:, 0], running[:, 1], running[:, 2]
        return self._admits(
            num_prompt_tokens,
            max_tokens,
            held,
            gen,
            cap,
            num_free_blocks,
            num_total_blocks,
            block_size,
        )

    def _admits(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        held: np.ndarray,
        gen: np.ndarray,
        cap: np.ndarray,
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        used_tokens = (num_total_blocks - num_free_blocks) * block_size
        held_tokens = float(held.sum())
        other_tokens = max(0.0, used_tokens - held_tokens)
        limit = self.estimator.fraction * num_total_blocks * block_size - other_tokens
        # No draw's peak exceeds every request (the candidate too) holding what it holds
        # plus all it may still generate (``worst_case_peak``): when even that fits, the
        # draws would admit, so none is made (a decode worker far from full, the common
        # case, decides in a few array operations instead of a table's dozens).
        worst = worst_case_peak(held_tokens, gen, cap, num_prompt_tokens, max_tokens)
        if worst < limit:
            self.last_peak_tokens = worst
            return True
        table = self.estimator.table_of(held, gen, cap)
        r_q = self.estimator.candidate_remaining(max_tokens)
        self.last_peak_tokens = table.peak_with(float(num_prompt_tokens), r_q)
        return self.last_peak_tokens < limit

    def observe_finished(self, output_len: int) -> None:
        self.history.observe(output_len)

    def record_exhaustion(self) -> None:
        self.num_mispredictions += 1
