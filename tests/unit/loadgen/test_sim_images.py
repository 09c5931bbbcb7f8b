"""How many tokens the simulated processor makes of an image (``loadgen.sim.images``),
against InternVL2's dynamic-resolution rule worked by hand: the grid of at most
``max_tiles`` tiles whose aspect ratio is nearest the image's, a tie to the larger grid
while the image has more than half its pixels, and a thumbnail when there is more than
one tile."""

from __future__ import annotations

import pytest

from loadgen.sim.images import ImageTokens

INTERNVL2 = ImageTokens(per_tile=256, tile_px=448, max_tiles=12)


@pytest.mark.parametrize(
    ("side", "tiles"),
    [
        (100, 1),  # smaller than a tile: still one
        (448, 1),
        (633, 1),  # 633² < ½ x 4 x 448²: 1x1 keeps the tie
        (634, 5),  # past it: 2x2 and a thumbnail
        (950, 5),  # 950² < ½ x 9 x 448²
        (951, 10),  # 3x3 and a thumbnail; 4x4 would be 16 tiles, over 12
        (4000, 10),
    ],
)
def test_squares_tile_on_square_grids(side: int, tiles: int) -> None:
    assert INTERNVL2.tiles(side, side) == tiles
    assert INTERNVL2.of_square(side) == 256 * tiles


def test_the_nearest_aspect_ratio_wins_within_the_tile_budget() -> None:
    assert INTERNVL2.tiles(1024, 768) == 13  # 4:3 exactly, 12 tiles and a thumbnail
    assert INTERNVL2.tiles(448, 896) == 3  # 1:2, two tiles and a thumbnail
    # 16:9 (1.78): within 12 tiles the nearest ratio is 2:1, as 2x1 and as 4x2: a tie,
    # and the image has more than half of 4x2's pixels, so 8 tiles and a thumbnail.
    assert INTERNVL2.tiles(1920, 1080) == 9
    # At most 6 tiles, 4:3 has no exact grid: 3x2 (1.5) is nearer than 2x2 (1.0).
    assert ImageTokens(256, 448, 6).tiles(1024, 768) == 7


def test_the_fixed_rule_ignores_the_size() -> None:
    llava = ImageTokens(576)
    assert llava.of_square(100) == llava.of_square(4000) == 576


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"per_tile": -1}, "image_tokens_per_image"),
        ({"tile_px": 0}, "image_tile_px"),
        ({"max_tiles": 0}, "max_image_tiles"),
    ],
)
def test_bad_rules_are_refused_by_name(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ImageTokens(**{"per_tile": 256, "tile_px": 448, **kwargs})
