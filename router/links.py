"""KV links priced from the transfers that really happened.

Every finished pull reports its bytes and how long it took. A link's cost is
``latency_s + num_bytes / bandwidth_bytes_per_s``; ``LinkFit`` fits both by least
squares over the last ``window`` transfers it saw. With too few transfers, or all
of nearly one size (no slope to fit), one of the two is measured and the other kept
from the seed, the one the seed says those transfers were mostly made of:

* bytes that the seed's bandwidth moves in more than its latency (wire time
  dominates): the seed latency is kept and the bandwidth measured,
  ``Σ bytes / Σ (duration − latency)``;
* smaller ones (fixed cost dominates): the seed bandwidth is kept and the latency
  measured, ``mean(duration − bytes / bandwidth)``. Measuring bandwidth from them
  would charge a transfer's fixed costs (RPCs, notifications, a first connection) to
  its few bytes, and extrapolate them to every larger transfer: one 8 KB pull of a
  tiny model that took 0.2 s priced 256 prompt tokens at 3.2 s and refused every
  long prompt of a tiny cluster, and with no transfer placed the estimate never
  moved again. Priced by the latency, larger transfers are placed and their sizes
  give the slope.

``Router`` keeps one fit per worker and folds every transfer into both ends, so a
worker's figure is what its NIC achieved; a pair is priced by its slower end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.cost_model import TransferCoeffs

__all__ = ["LinkFit"]

_MIN_WIRE_S = 1e-6  # a transfer faster than its latency still moved its bytes
_MIN_SPREAD = 0.25  # coefficient of variation of sizes below which no slope is fitted


@dataclass(frozen=True, slots=True)
class _Transfer:
    num_bytes: float
    duration_s: float


class LinkFit:
    def __init__(self, seed: TransferCoeffs, window: int = 64) -> None:
        self._seed = seed
        self._window = window
        self._recent: deque[_Transfer] = deque()
        # Running sums over the window (bytes, duration, bytes², bytes·duration): a
        # transfer costs O(1), not O(window) (the simulator reports one per request).
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self._num_since_resum = 0
        self.estimate = seed

    @property
    def num_observed(self) -> int:
        return len(self._recent)

    def observe(self, num_bytes: int, duration_s: float) -> TransferCoeffs:
        """Fold one transfer in; returns the new estimate."""
        if num_bytes <= 0 or duration_s < 0:
            return self.estimate
        t = _Transfer(float(num_bytes), float(duration_s))
        self._recent.append(t)
        self._add(t, 1.0)
        if len(self._recent) > self._window:
            self._add(self._recent.popleft(), -1.0)
        self._num_since_resum += 1
        if self._num_since_resum >= self._window:  # bound the rounding drift of the sums
            self._num_since_resum = 0
            self._sums = [0.0, 0.0, 0.0, 0.0]
            for old in self._recent:
                self._add(old, 1.0)
        self.estimate = self._fit()
        return self.estimate

    def _add(self, t: _Transfer, sign: float) -> None:
        sums = self._sums
        b, d = t.num_bytes, t.duration_s
        sums[0] += sign * b
        sums[1] += sign * d
        sums[2] += sign * b * b
        sums[3] += sign * b * d

    def _fit(self) -> TransferCoeffs:
        n = len(self._recent)
        sum_b, sum_d, sum_bb, sum_bd = self._sums
        mean_b, mean_d = sum_b / n, sum_d / n
        var_b = max(0.0, sum_bb / n - mean_b * mean_b)
        if n >= 3 and var_b > (_MIN_SPREAD * mean_b) ** 2:
            slope = (sum_bd / n - mean_b * mean_d) / var_b
            latency_s = mean_d - slope * mean_b
            if slope > 0 and latency_s >= 0:
                return TransferCoeffs(bandwidth_bytes_per_s=1.0 / slope, latency_s=latency_s)
        seed = self._seed
        if mean_b / seed.bandwidth_bytes_per_s < seed.latency_s:  # mostly fixed cost
            latency_s = max(0.0, mean_d - mean_b / seed.bandwidth_bytes_per_s)
            return TransferCoeffs(
                bandwidth_bytes_per_s=seed.bandwidth_bytes_per_s, latency_s=latency_s
            )
        latency_s = min(seed.latency_s, min(t.duration_s for t in self._recent))
        wire_s = sum(max(t.duration_s - latency_s, _MIN_WIRE_S) for t in self._recent)
        return TransferCoeffs(bandwidth_bytes_per_s=sum_b / wire_s, latency_s=latency_s)
