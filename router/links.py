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

from router.profile import TransferCoeffs

__all__ = ["LinkFit", "Links"]

_MIN_WIRE_S = 1e-6  # a transfer faster than its latency still moved its bytes
_MIN_SPREAD = 0.25  # coefficient of variation of sizes below which no slope is fitted
# A link's figures reach the view only when they moved this much: each transfer nudges
# the fit, and rebuilding both ends' rows for every nudge would double the view's work.
_PUBLISH_TOLERANCE = 0.05


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


class Links:
    """One ``LinkFit`` per worker, and the figures the view shows for each (``shown``),
    which follow the fit only when it moved by more than a tolerance."""

    def __init__(self, seed: TransferCoeffs) -> None:
        self._seed = seed
        self._fits: dict[str, LinkFit] = {}
        self._shown: dict[str, TransferCoeffs] = {}

    def observe(self, worker_id: str, num_bytes: int, duration_s: float) -> bool:
        """Fold a transfer into the worker's fit; True if what the view shows changed."""
        fit = self._fits.get(worker_id)
        if fit is None:
            fit = self._fits[worker_id] = LinkFit(self._seed)
        estimate = fit.observe(num_bytes, duration_s)
        shown = self._shown.get(worker_id)
        if shown is not None and not _moved(shown, estimate):
            return False
        self._shown[worker_id] = estimate
        return True

    def estimate(self, worker_id: str) -> TransferCoeffs:
        """The worker's link as measured (the seed until a transfer is seen)."""
        fit = self._fits.get(worker_id)
        return fit.estimate if fit is not None else self._seed

    def shown(self, worker_id: str) -> TransferCoeffs | None:
        """What the view shows for the worker; None: no transfer seen (the profile's)."""
        return self._shown.get(worker_id)

    def forget(self, worker_id: str) -> None:
        self._fits.pop(worker_id, None)
        self._shown.pop(worker_id, None)


def _moved(shown: TransferCoeffs, now: TransferCoeffs) -> bool:
    bw, lat = shown.bandwidth_bytes_per_s, shown.latency_s
    return abs(now.bandwidth_bytes_per_s - bw) > _PUBLISH_TOLERANCE * bw or abs(
        now.latency_s - lat
    ) > _PUBLISH_TOLERANCE * max(lat, 1e-4)
