"""Online correction of the cost model from what requests actually saw.

The cost model predicts each plan's TTFT (queue + prefill + transfer, from the moment it
is placed) and TPOT (its decode worker's step). A worker may run slower or faster than
its profile says (another tenant on the host, a different CPU, a cold cache). Each
finished request reports its observed TTFT and TPOT against the plan's prediction
(``Outcome``); per worker and per quantity, ``Correction`` fits

    observed ≈ bias_s + scale · predicted

by least squares over a short window of the latest pairs, so a change in a worker's
speed is followed within ``window`` requests. Pairs also age out after ``max_age_s``
(when the reader passes the time): a correction learned while a worker was slow must
not outlive the slowness, and while admission refuses everything a worker teaches
nothing new, so without ageing one slow spell would keep the worker refused for good.
With few pairs, or predictions that barely vary, it falls back to a pure bias (the mean
error); ``scale`` is clamped so that one odd request cannot turn the fit upside down,
and holds only over the predictions it was fitted on (``LinearFit``).

Pure: no clock reads; the caller measures and passes durations.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Correction", "CorrectionSettings", "LinearFit", "Outcome", "OutcomeCorrector"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request: its plan's predictions and what was measured.

    TTFT counts from the plan's placement to the first token; TPOT is the mean time
    per token after the second token arrived, the decode steps the plan predicts (the
    gap before it is the KV hand-off); None when no token came after that."""

    prefill_worker: str
    decode_worker: str  # the prefill worker's id when colocated
    predicted_ttft_s: float | None
    observed_ttft_s: float | None
    predicted_tpot_s: float | None
    observed_tpot_s: float | None
    at_s: float | None = None  # when it was measured (None: never ages out)
    # Whether the request met its targets as its client saw them (None: not known):
    # TTFT from its arrival, TPOT over every token after the first, hand-off included.
    met_ttft: bool | None = None
    met_tpot: bool | None = None


@dataclass(frozen=True, slots=True)
class CorrectionSettings:
    window: int = 32  # pairs kept per worker and quantity
    min_samples: int = 4  # fewer: no correction
    min_scale: float = 0.25
    max_scale: float = 8.0
    max_age_s: float = 30.0  # older pairs are dropped when read with the time
    # Predictions must spread this much (relative std) for a scale to be fitted.
    min_relative_spread: float = 0.05


@dataclass(frozen=True, slots=True)
class LinearFit:
    """``observed = bias_s + scale * predicted`` over the predictions it was fitted on,
    ``[lo_s, hi_s]``; past them the error at the nearest edge is carried at scale 1.

    A scale is not extrapolated: the pairs are the cost model's predictions as they
    were, and a young cost model's grow as it learns. Live, a fresh 1 prefill + 1 decode
    cluster's first four prompts were predicted 0.19-0.80 s and took 1.65-4.81 s (a
    fit of 0.98 s + 4.97x); the model then predicted 2.9-4.4 s, which the fit made
    15-23 s against a 9.8 s target, and 39 of the next 49 prompts were refused while the
    ones admitted took at most 5.2 s. With the edge's error carried, 2.9-4.4 s are
    priced 7.1-8.6 s."""

    bias_s: float = 0.0
    scale: float = 1.0
    lo_s: float = -math.inf
    hi_s: float = math.inf

    def apply(self, predicted_s: float) -> float:
        edge = min(max(predicted_s, self.lo_s), self.hi_s)
        return max(0.0, self.bias_s + self.scale * edge + (predicted_s - edge))


_IDENTITY = LinearFit()


class Correction:
    """One worker's one quantity: the window of (predicted, observed) and its fit."""

    def __init__(self, settings: CorrectionSettings) -> None:
        self._settings = settings
        # (predicted, observed, when measured or None), oldest first
        self._pairs: deque[tuple[float, float, float | None]] = deque(maxlen=settings.window)
        self._fit: LinearFit | None = _IDENTITY

    def observe(self, predicted_s: float, observed_s: float, at_s: float | None = None) -> None:
        self._pairs.append((predicted_s, observed_s, at_s))
        self._fit = None  # refitted when next read

    def expire(self, now_s: float) -> None:
        """Drop the pairs measured more than ``max_age_s`` before ``now_s``."""
        horizon = now_s - self._settings.max_age_s
        while self._pairs and (at_s := self._pairs[0][2]) is not None and at_s < horizon:
            self._pairs.popleft()
            self._fit = None

    @property
    def num_samples(self) -> int:
        return len(self._pairs)

    @property
    def fit(self) -> LinearFit:
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> LinearFit:
        s = self._settings
        n = len(self._pairs)
        if n < s.min_samples:
            return _IDENTITY
        mean_p = sum(p for p, _, _ in self._pairs) / n
        mean_o = sum(o for _, o, _ in self._pairs) / n
        var_p = sum((p - mean_p) ** 2 for p, _, _ in self._pairs) / n
        if var_p <= (s.min_relative_spread * mean_p) ** 2 or var_p == 0.0:
            return LinearFit(bias_s=mean_o - mean_p, scale=1.0)
        cov = sum((p - mean_p) * (o - mean_o) for p, o, _ in self._pairs) / n
        scale = min(s.max_scale, max(s.min_scale, cov / var_p))
        predicted = [p for p, _, _ in self._pairs]
        return LinearFit(mean_o - scale * mean_p, scale, min(predicted), max(predicted))


class OutcomeCorrector:
    """Per-worker corrections of TTFT (keyed by the prefill worker) and TPOT (keyed by
    the decode worker), fed by ``observe`` and read by ``ttft_s`` / ``tpot_s``."""

    def __init__(self, settings: CorrectionSettings | None = None) -> None:
        self.settings = settings or CorrectionSettings()
        self._ttft: dict[str, Correction] = {}
        self._tpot: dict[str, Correction] = {}

    def observe(self, outcome: Outcome) -> None:
        o = outcome
        if o.predicted_ttft_s is not None and o.observed_ttft_s is not None:
            ttft = self._get(self._ttft, o.prefill_worker)
            ttft.observe(o.predicted_ttft_s, o.observed_ttft_s, o.at_s)
        if o.predicted_tpot_s is not None and o.observed_tpot_s is not None:
            tpot = self._get(self._tpot, o.decode_worker)
            tpot.observe(o.predicted_tpot_s, o.observed_tpot_s, o.at_s)

    def ttft_s(self, worker_id: str, predicted_s: float, now_s: float | None = None) -> float:
        """``predicted_s`` corrected by what ``worker_id`` taught (``now_s``: only what
        it taught within ``max_age_s``)."""
        return _corrected(self._ttft.get(worker_id), predicted_s, now_s)

    def tpot_s(self, worker_id: str, predicted_s: float, now_s: float | None = None) -> float:
        return _corrected(self._tpot.get(worker_id), predicted_s, now_s)

    def ttft_learned(self, worker_id: str, now_s: float | None = None) -> bool:
        """Whether ``ttft_s`` corrects ``worker_id``'s predictions by what it taught
        (``now_s``: within ``max_age_s``), rather than passing them through."""
        c = self._ttft.get(worker_id)
        if c is None:
            return False
        if now_s is not None:
            c.expire(now_s)
        return c.num_samples >= self.settings.min_samples

    def ttft_fit(self, worker_id: str) -> LinearFit:
        c = self._ttft.get(worker_id)
        return _IDENTITY if c is None else c.fit

    def tpot_fit(self, worker_id: str) -> LinearFit:
        c = self._tpot.get(worker_id)
        return _IDENTITY if c is None else c.fit

    def forget(self, worker_id: str) -> None:
        """A worker died or changed role: what it taught no longer holds."""
        self._ttft.pop(worker_id, None)
        self._tpot.pop(worker_id, None)

    def _get(self, table: dict[str, Correction], worker_id: str) -> Correction:
        c = table.get(worker_id)
        if c is None:
            c = table[worker_id] = Correction(self.settings)
        return c


def _corrected(c: Correction | None, predicted_s: float, now_s: float | None) -> float:
    if c is None:
        return predicted_s
    if now_s is not None:
        c.expire(now_s)
    return c.fit.apply(predicted_s)
