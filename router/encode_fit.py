"""The encode cost term ``a + b·m`` (``m`` image tokens), fitted from observed encodes.

Seeded from the profile's ``encode`` coefficients. Each finished encode (its
worker-measured duration and image-token count) joins a window of recent samples;
with two or more distinct ``m`` in the window the fit is ordinary least squares,
otherwise (every request the same size, the common case: images are a fixed number
of tokens each) the seed's ``a`` is kept and ``b`` is the one slope through the
samples. Neither coefficient goes below zero.
"""

from __future__ import annotations

from collections import deque

from router.cost_model import EncodeCoeffs

__all__ = ["EncodeFit"]

_WINDOW = 64


class EncodeFit:
    def __init__(self, seed: EncodeCoeffs, window: int = _WINDOW) -> None:
        self.seed = seed
        self.estimate = seed
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def observe(self, num_image_tokens: int, duration_s: float) -> EncodeCoeffs:
        if num_image_tokens > 0 and duration_s >= 0:
            self._samples.append((float(num_image_tokens), duration_s))
            self.estimate = self._fit()
        return self.estimate

    def encode_s(self, num_image_tokens: float) -> float:
        e = self.estimate
        return e.a + e.b * num_image_tokens if num_image_tokens > 0 else 0.0

    def _fit(self) -> EncodeCoeffs:
        ms = [m for m, _ in self._samples]
        ds = [d for _, d in self._samples]
        n = len(ms)
        mean_m, mean_d = sum(ms) / n, sum(ds) / n
        var_m = sum((m - mean_m) ** 2 for m in ms)
        if var_m > 1e-9 * max(1.0, mean_m**2):
            b = sum((m - mean_m) * (d - mean_d) for m, d in zip(ms, ds)) / var_m
            b = max(0.0, b)
            return EncodeCoeffs(a=max(0.0, mean_d - b * mean_m), b=b)
        a = self.seed.a
        b = max(0.0, sum((d - a) * m for m, d in zip(ms, ds)) / sum(m * m for m in ms))
        return EncodeCoeffs(a=a, b=b)
