"""Image placeholder tokens in a prompt: expand them, find each image's run. Torch-free.

LLaVA's processor replaces each ``<image>`` with ``num_image_tokens`` copies of it;
image ``k`` then owns the ``k``-th run of that length (adjacent images make one long
run, split in order).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expand_image_tokens", "image_offsets"]


def expand_image_tokens(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: int
) -> list[int]:
    """Each placeholder becomes ``num_image_tokens`` of them, as LLaVA's processor expands ``<image>``."""
    out: list[int] = []
    for t in token_ids:
        if t == image_token_id:
            out.extend([t] * num_image_tokens)
        else:
            out.append(t)
    return out


def image_offsets(
    token_ids: Sequence[int], image_token_id: int, num_image_tokens: int
) -> list[int]:
    """The prompt position of each image's first placeholder (an expanded prompt), in order."""
    offsets: list[int] = []
    run = 0
    for i, t in enumerate(token_ids):
        run = run + 1 if t == image_token_id else 0
        if run and (run - 1) % num_image_tokens == 0:
            offsets.append(i)
    return offsets
