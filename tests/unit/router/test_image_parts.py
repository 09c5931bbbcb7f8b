"""A request's images cut into contiguous parts over encode workers: the largest part
as small as contiguous parts allow (in tokens), the largest on the first worker."""

from __future__ import annotations

import itertools
import random

import pytest

from router.image_parts import image_splits, part_tokens, split_images

WORKERS = ("a", "b", "c", "d", "e", "f", "g", "h")


def _cuts(n: int, k: int) -> list[list[tuple[int, int]]]:
    """Every way to cut ``n`` images into ``k`` contiguous non-empty parts."""
    out = []
    for inner in itertools.combinations(range(1, n), k - 1):
        edges = (0, *inner, n)
        out.append(list(itertools.pairwise(edges)))
    return out


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("num_workers", range(1, 6))
def test_equal_images_are_cut_by_count_the_first_parts_taking_the_extra(
    n: int, num_workers: int
) -> None:
    parts = split_images((256,) * n, WORKERS[:num_workers])
    k = min(n, num_workers)
    sizes = [stop - start for _, start, stop in parts]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == n and len(parts) == k
    assert [w for w, _, _ in parts] == list(WORKERS[:k])  # in image order, worker order


def test_a_large_image_is_a_part_of_its_own_and_goes_to_the_first_worker() -> None:
    tiles = (2560, 256, 256, 256)  # a 10-tile image, then three 1-tile ones
    assert split_images(tiles, ("a", "b")) == (("a", 0, 1), ("b", 1, 4))
    assert split_images(tiles, ("a", "b", "c")) == (("a", 0, 1), ("b", 1, 3), ("c", 3, 4))
    # Last in the request, it still goes to the first (least loaded) worker.
    assert split_images(tiles[::-1], ("a", "b")) == (("b", 0, 3), ("a", 3, 4))
    # By count, the first half would have been 2816 tokens against 512.
    assert part_tokens(tiles, 0, 1) == 2560 and part_tokens(tiles, 1, 4) == 768


def test_the_largest_part_is_the_least_any_contiguous_cut_gives() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 7)
        tokens = tuple(rng.choice((256, 1280, 2560, 3328)) for _ in range(n))
        splits = image_splits(tokens, WORKERS)
        assert len(splits) == n  # one per number of parts, 1..n
        for k, parts in enumerate(splits, start=1):
            assert len(parts) == k
            assert [(s, e) for _, s, e in parts] == list(
                itertools.pairwise([0, *(e for _, _, e in parts)])
            )  # contiguous, in image order, covering every image
            largest = max(part_tokens(tokens, s, e) for _, s, e in parts)
            best = min(max(sum(tokens[s:e]) for s, e in c) for c in _cuts(n, k))
            assert largest == best, (tokens, k, parts)
            ranked = sorted(parts, key=lambda p: -part_tokens(tokens, p[1], p[2]))
            assert [w for w, _, _ in ranked] == list(WORKERS[:k])  # largest first


def test_no_image_or_no_worker_gives_no_part() -> None:
    assert split_images((), ("a",)) == ()
    assert split_images((256,), ()) == ()
