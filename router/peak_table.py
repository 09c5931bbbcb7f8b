"""The peak future KV of one decode worker's running set, as a table of its draws
(step 3 of ``router.estimator``'s method): ``max_k (k·r_(k) + Σ_{j≤k} c_(j))`` per draw,
with the prefix and suffix maxima that price a candidate exactly without drawing the
set again (``PeakTable.peak_with``).

The router keeps one table per running set (``router.running_sets``) and prices many
candidates against it; the engine's admission rule builds one per decision.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PeakTable", "peak_per_draw"]


def peak_per_draw(remaining: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``max_k (k·r_(k) + Σ_{j≤k} c_(j))`` for each row of ``remaining`` (S, n)."""
    num_draws, n = remaining.shape
    if n == 0:
        return np.zeros(num_draws)
    order = np.argsort(-remaining, axis=1, kind="stable")
    r = np.take_along_axis(remaining, order, axis=1)
    c = np.asarray(held, dtype=np.float64)[order]
    terms = np.arange(1, n + 1) * r + np.cumsum(c, axis=1)
    peaks: np.ndarray = terms.max(axis=1)
    return peaks


_INDEX_ARRAYS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _index_arrays(num_draws: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``PeakTable``'s (row of each draw as a column, ranks 1..n), made once per shape."""
    arrays = _INDEX_ARRAYS.get((num_draws, n))
    if arrays is None:
        arrays = _INDEX_ARRAYS[(num_draws, n)] = (
            np.arange(num_draws)[:, None],
            np.arange(1, n + 1, dtype=np.float64),
        )
    return arrays


class PeakTable:
    """One worker's draws, sorted, with the prefix/suffix maxima that price a
    candidate ``(c_q, r_q)`` exactly: inserting it at position ``p`` leaves terms
    before ``p`` alone, adds ``r_k + c_q`` to each term after, and adds its own term
    ``(p+1)·r_q + C_p + c_q``."""

    __slots__ = (
        "_c",
        "_cprefix",
        "_prefmax",
        "_r",
        "_sufmax",
        "_terms",
        "num_running",
        "peak_tokens",
        "peaks",
    )

    def __init__(self, remaining: np.ndarray, held: np.ndarray) -> None:
        num_draws, n = remaining.shape
        self.num_running = n
        # Methods rather than numpy's module functions, the index arrays kept per shape,
        # and the last maximum over the few draws in Python: at a decode worker's size
        # the calls, not the arithmetic, are the time of a table, and the router draws
        # one per new running set.
        rows, ranks = _index_arrays(num_draws, n)
        order = (-remaining).argsort(axis=1, kind="stable")
        self._r = remaining[rows, order]
        self._c = np.asarray(held, dtype=np.float64)[order].cumsum(axis=1)
        self._terms = ranks * self._r
        self._terms += self._c
        self.peaks: np.ndarray = self._terms.max(axis=1) if n else np.zeros(num_draws)
        self.peak_tokens = float(max(self.peaks.tolist()))
        # Built on the first ``peak_with``: most tables are only read for their peak.
        self._cprefix: np.ndarray | None = None
        self._prefmax: np.ndarray | None = None
        self._sufmax: np.ndarray | None = None

    def _prepare(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._cprefix is None or self._prefmax is None or self._sufmax is None:
            num_draws = self._r.shape[0]
            cprefix = np.concatenate([np.zeros((num_draws, 1)), self._c], axis=1)
            prefmax = np.maximum.accumulate(self._terms, axis=1)
            grown = (self._terms + self._r)[:, ::-1]
            suffix = np.maximum.accumulate(grown, axis=1)[:, ::-1]
            sufmax = np.concatenate([suffix, np.full((num_draws, 1), -np.inf)], axis=1)
            self._cprefix, self._prefmax, self._sufmax = cprefix, prefmax, sufmax
            return cprefix, prefmax, sufmax
        return self._cprefix, self._prefmax, self._sufmax

    def peak_with(self, held_tokens: float, remaining: np.ndarray) -> float:
        """The estimate with a candidate holding ``held_tokens`` and ``remaining[s]``
        tokens to go in draw ``s`` (its length must be at least the table's S)."""
        num_draws = self._r.shape[0]
        r_q = remaining[:num_draws]
        if self.num_running == 0:
            return float((r_q + held_tokens).max())
        cprefix, prefmax, sufmax = self._prepare()
        ahead = (self._r >= r_q[:, None]).sum(axis=1)  # old requests before the candidate
        rows = np.arange(num_draws)
        before = np.where(ahead > 0, prefmax[rows, np.maximum(ahead - 1, 0)], -np.inf)
        own = (ahead + 1) * r_q + cprefix[rows, ahead] + held_tokens
        after = sufmax[rows, ahead] + held_tokens
        return float(np.maximum(np.maximum(before, own), after).max())
