"""How one request's images are split over encode workers: contiguous parts (a plan
names each part as a range of images), one part per worker, at most one per image.

The request waits for its slowest part, so the parts are cut to make the largest as
small as contiguous parts allow, counted in image tokens: a 1344 px image tiled into
ten tiles is one part of its own beside three one-tile images, not the first half of
four "equal" images. Images of equal size (every image of a fixed-resolution model,
LLaVA's) are cut by count: near-equal parts, the first ones taking the extra image.
Among the cuts whose largest part is least, each part takes as many images as it may
while leaving one for each part after it.

The parts are listed in image order; the largest goes to the first worker named (a
caller names them least loaded first), the next largest to the second, and so on
(ties in image order).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["image_splits", "part_tokens", "split_images"]

Parts = tuple[tuple[str, int, int], ...]


def split_images(tokens: Sequence[float], workers: tuple[str, ...]) -> Parts:
    """``tokens`` (each image's, in order) in ``min(len(tokens), len(workers))``
    parts, as (worker, first image, end image)."""
    return image_splits(tokens, workers)[-1]


def image_splits(tokens: Sequence[float], workers: tuple[str, ...]) -> list[Parts]:
    """``split_images`` over the first ``k`` workers, for each ``k`` from 1 to
    ``min(len(tokens), len(workers))`` (computed together: one search for all)."""
    n = len(tokens)
    most = min(n, len(workers))
    if most == 0:
        return [()]
    if _equal(tokens):  # weighed by count: parts of equal count are equal, exactly
        prefix = [float(i) for i in range(n + 1)]
        cuts = [_even_cuts(n, k) for k in range(1, most + 1)]
    else:
        prefix = [0.0] * (n + 1)
        for i, m in enumerate(tokens):
            prefix[i + 1] = prefix[i] + m
        bounds = _least_largest_part(prefix, most)
        cuts = [_greedy_cuts(prefix, k, bounds[k]) for k in range(1, most + 1)]
    return [_assign(c, prefix, workers) for c in cuts]


def part_tokens(tokens: Sequence[float], start: int, stop: int) -> float:
    """The tokens of images ``start:stop`` (equal images: the count times one's, the
    same float however the part was cut)."""
    if _equal(tokens):
        return (stop - start) * tokens[0]
    return float(sum(tokens[start:stop]))


def _equal(tokens: Sequence[float]) -> bool:
    first = tokens[0]
    return all(m == first for m in tokens)


def _even_cuts(n: int, k: int) -> list[tuple[int, int]]:
    cuts, start = [], 0
    for j in range(k):
        size = n // k + (1 if j < n % k else 0)
        cuts.append((start, start + size))
        start += size
    return cuts


def _least_largest_part(prefix: list[float], most: int) -> list[float]:
    """For ``k`` parts (index ``k``, 1..``most``): the least possible largest part of
    images ``0:n``. ``best[i]`` is that of the suffix ``i:n`` in the parts so far."""
    n = len(prefix) - 1
    total = prefix[n]
    best = [total - prefix[i] for i in range(n + 1)]  # one part
    bounds = [0.0, best[0]]
    for k in range(2, most + 1):
        nxt = [float("inf")] * (n + 1)
        for i in range(n - k + 1):  # k parts need k images
            nxt[i] = min(max(prefix[m] - prefix[i], best[m]) for m in range(i + 1, n - k + 2))
        best = nxt
        bounds.append(best[0])
    return bounds


def _greedy_cuts(prefix: list[float], k: int, bound: float) -> list[tuple[int, int]]:
    """``k`` parts of at most ``bound`` tokens, each as long as it may be while
    leaving an image for each part after it (the last takes the rest)."""
    n = len(prefix) - 1
    cuts, start = [], 0
    for j in range(k - 1):
        end = start + 1
        last = n - (k - 1 - j)  # leave one image for each later part
        while end < last and prefix[end + 1] - prefix[start] <= bound:
            end += 1
        cuts.append((start, end))
        start = end
    cuts.append((start, n))
    return cuts


def _assign(cuts: list[tuple[int, int]], prefix: list[float], workers: tuple[str, ...]) -> Parts:
    """The cuts in image order, the j-th largest on ``workers[j]``."""
    sizes = [prefix[stop] - prefix[start] for start, stop in cuts]
    by_size = sorted(range(len(cuts)), key=lambda j: -sizes[j])  # stable: ties in order
    worker_of = dict(zip(by_size, workers, strict=False))
    return tuple((worker_of[j], start, stop) for j, (start, stop) in enumerate(cuts))
