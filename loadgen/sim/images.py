"""How many placeholder tokens the simulated model's processor makes of an image.

Two rules, those of the two kinds of vision-language model the shipped profiles price:

* **fixed** (LLaVA-1.5, the embedded engine's ``tiny-vl``): every image is resized to
  the vision tower's input, ``per_tile`` tokens whatever its size;
* **tiled** (InternVL2's dynamic resolution, ``tile_px`` set): the image is cut into
  ``tile_px`` squares on the grid of at most ``max_tiles`` tiles whose aspect ratio is
  nearest the image's, and a grid of more than one tile gets a thumbnail tile too;
  ``per_tile`` tokens a tile. Among grids as near as each other, the one with more
  tiles wins while the image has more than half of its pixels. With InternVL2's 448 px
  and 12: a square of up to 633 px is one tile (256 tokens), up to 950 px 2x2 and a
  thumbnail (1280), larger 3x3 and a thumbnail (2560); 1024x768 is 4x3 and a
  thumbnail. The vision tower encodes every tile, so encode time grows with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

__all__ = ["ImageTokens"]


@dataclass(frozen=True)
class ImageTokens:
    per_tile: int  # placeholder tokens per tile (fixed rule: per image)
    tile_px: int | None = None  # None: the fixed rule
    max_tiles: int = 12

    def __post_init__(self) -> None:
        if self.per_tile < 0:
            raise ValueError(f"image_tokens_per_image (per tile) must be >= 0, got {self.per_tile}")
        if self.tile_px is not None and self.tile_px < 1:
            raise ValueError(f"image_tile_px must be >= 1, got {self.tile_px}")
        if self.max_tiles < 1:
            raise ValueError(f"max_image_tiles must be >= 1, got {self.max_tiles}")

    def of_square(self, side_px: int) -> int:
        """Tokens for a ``side_px`` x ``side_px`` image (the load generator's images)."""
        return self.per_tile * self.tiles(side_px, side_px)

    def tiles(self, width_px: int, height_px: int) -> int:
        """Tiles the vision tower encodes for a ``width_px`` x ``height_px`` image."""
        if self.tile_px is None:
            return 1
        aspect = width_px / height_px
        half_pixels = 0.5 * self.tile_px * self.tile_px
        best, best_diff = 1, math.inf
        for cols, rows in self._grids:
            diff = abs(aspect - cols / rows)
            if diff < best_diff or (
                diff == best_diff and width_px * height_px > half_pixels * cols * rows
            ):
                best, best_diff = cols * rows, diff
        return best + 1 if best > 1 else best

    @cached_property
    def _grids(self) -> list[tuple[int, int]]:
        """(columns, rows) of every grid of at most ``max_tiles`` tiles, fewest first."""
        n = self.max_tiles
        grids = [(c, r) for c in range(1, n + 1) for r in range(1, n // c + 1)]
        return sorted(grids, key=lambda g: (g[0] * g[1], g))
