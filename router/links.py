"""KV links priced from the transfers that really happened.

Every finished pull reports its bytes and how long it took. A link's cost is
``latency_s + num_bytes / bandwidth_bytes_per_s``; ``LinkFit`` fits both by least
squares over the last ``window`` transfers it saw. With too few transfers, or all
of nearly one size (no slope to fit), it keeps the seed latency and measures only
the bandwidth: ``Σ bytes / Σ (duration − latency)``.

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
        self._recent: deque[_Transfer] = deque(maxlen=window)
        self.estimate = seed

    @property
    def num_observed(self) -> int:
        return len(self._recent)

    def observe(self, num_bytes: int, duration_s: float) -> TransferCoeffs:
        """Fold one transfer in; returns the new estimate."""
        if num_bytes <= 0 or duration_s < 0:
            return self.estimate
        self._recent.append(_Transfer(float(num_bytes), float(duration_s)))
        self.estimate = self._fit()
        return self.estimate

    def _fit(self) -> TransferCoeffs:
        n = len(self._recent)
        mean_b = sum(t.num_bytes for t in self._recent) / n
        mean_d = sum(t.duration_s for t in self._recent) / n
        var_b = sum((t.num_bytes - mean_b) ** 2 for t in self._recent) / n
        if n >= 3 and var_b > (_MIN_SPREAD * mean_b) ** 2:
            cov = sum((t.num_bytes - mean_b) * (t.duration_s - mean_d) for t in self._recent) / n
            slope = cov / var_b
            latency_s = mean_d - slope * mean_b
            if slope > 0 and latency_s >= 0:
                return TransferCoeffs(bandwidth_bytes_per_s=1.0 / slope, latency_s=latency_s)
        latency_s = min(self._seed.latency_s, min(t.duration_s for t in self._recent))
        wire_s = sum(max(t.duration_s - latency_s, _MIN_WIRE_S) for t in self._recent)
        return TransferCoeffs(bandwidth_bytes_per_s=mean_b * n / wire_s, latency_s=latency_s)
