"""Generated images for image requests: random PNGs of a given size, no downloads.

Each request's images are seeded by its id and position, so a run is reproducible and
no two images repeat (the server's encoder-output cache never hits by accident).
"""

from __future__ import annotations

import base64
import io
import zlib
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["image_parts", "synthetic_png"]


@lru_cache(maxsize=256)
def synthetic_png(seed: int, side: int) -> bytes:
    """A ``side`` x ``side`` RGB PNG of seeded noise (blocky, so it compresses a little)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, (max(1, side // 8), max(1, side // 8), 3), dtype=np.uint8)
    image = Image.fromarray(cells).resize((side, side), Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_parts(request_id: str, sides: tuple[int, ...]) -> list[dict[str, Any]]:
    """OpenAI ``image_url`` content parts (``data:`` URLs) for a request's images."""
    parts = []
    for index, side in enumerate(sides):
        seed = zlib.crc32(f"{request_id}/{index}".encode())
        data = base64.b64encode(synthetic_png(seed, side)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
    return parts
