"""The encode cost term ``a + b·m`` (``m`` image tokens), fitted from observed encodes.

Seeded from the profile's ``encode`` coefficients. Each finished encode (its
worker-measured duration and image-token count) joins a window of recent samples;
with two or more distinct ``m`` in the window the fit is ordinary least squares,
otherwise (every request the same size, the common case: images are a fixed number
of tokens each) the seed's ``a`` is kept and ``b`` is the one slope through the
samples. Neither coefficient goes below zero.

``price_encode`` prices a request's encode for ``slo_goodput`` (step 4 of its module
docstring): on its prefill worker, or split over the least-queued encode workers.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from router.image_parts import image_splits, part_tokens
from router.profile import EncodeCoeffs
from router.types import RequestProfile, Role

if TYPE_CHECKING:
    from router.worker_table import WorkerTable

__all__ = ["EncodeFit", "price_encode", "remote_for"]

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
        return self.estimate.encode_s(num_image_tokens)

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


def price_encode(
    t: WorkerTable,
    fit: EncodeFit,
    profile: RequestProfile,
    wait_s: np.ndarray | float,
    own_s: float,
) -> tuple[np.ndarray | float, np.ndarray | bool, tuple[tuple[str, int, int], ...]]:
    """Per prefill worker of ``t``: the TTFT the encode adds and whether it runs
    remotely; and the parts (encode worker, first image, end image) that would run it.
    ``wait_s``: each prefill worker's queue wait for the request; ``own_s``: the
    encode on the prefill worker itself."""
    if profile.num_image_tokens <= 0:
        return 0.0, False, ()
    mask = t.is_role(Role.ENCODE)
    if not mask.any() or t.workers is None:
        return own_s, False, ()
    b = fit.estimate.b
    encoders = np.flatnonzero(mask)
    order = encoders[np.argsort(t.queued_tokens[encoders], kind="stable")]
    tokens = profile.tokens_per_image()
    ids = tuple(t.workers[int(e)].worker_id for e in order[: len(tokens)])
    index = dict(zip(ids, order.tolist(), strict=False))
    ready_s = math.inf
    parts: tuple[tuple[str, int, int], ...] = ()
    for split in image_splits(tokens, ids):  # over the 1, 2, ... least-queued encoders
        ready_k = max(
            b * float(t.queued_tokens[index[wid]])
            + fit.encode_s(part_tokens(tokens, start, stop))
            + float(t.link_latency_s[index[wid]])
            for wid, start, stop in split
        )
        if ready_k < ready_s - 1e-9:  # a tie keeps fewer parts
            ready_s, parts = ready_k, split
    remote_s = np.maximum(0.0, ready_s - wait_s)
    # A profile that prices no encode (and nothing fitted yet) defers to the operator,
    # who started encode workers to use them.
    remote = remote_s <= 2.0 * own_s if own_s > 0 else np.full_like(t.queued_tokens, True, bool)
    return np.where(remote, remote_s, own_s), remote, parts


def remote_for(t: WorkerTable, prefill_worker: str, remote: np.ndarray | bool) -> bool:
    """Whether ``price_encode`` said remote for ``prefill_worker``."""
    if not isinstance(remote, np.ndarray):
        return bool(remote)
    workers = t.workers or ()
    index = next(i for i, w in enumerate(workers) if w.worker_id == prefill_worker)
    return bool(remote[index])
