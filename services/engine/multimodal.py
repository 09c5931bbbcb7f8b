"""Images in the engine: resolve a request's images to embeddings, and place them in a step.

A request names each image by ``ImageInput``: where its placeholder run starts in the
prompt, its length, its content hash, and either the encoded file (``data``: the
engine decodes, preprocesses and encodes it, colocated) or precomputed embeddings
(from an encode worker). Resolved embeddings stay on the request for its life, so a
preempted request recomputes its prompt without encoding again. The encoder-output
cache, keyed by content hash, spares a repeated image its encode.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.llava import LoadedVision
from services.engine.messages import ImageInput, InvalidRequestError
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest

__all__ = ["EncoderCache", "ImageResolver", "image_embeds_for_step"]


class EncoderCache:
    """LRU of image embeddings by content hash, bounded in entries."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, content_hash: str) -> torch.Tensor | None:
        found = self._entries.get(content_hash)
        if found is not None:
            self._entries.move_to_end(content_hash)
        return found

    def put(self, content_hash: str, embeddings: torch.Tensor) -> None:
        if self.max_entries <= 0:
            return
        self._entries[content_hash] = embeddings
        self._entries.move_to_end(content_hash)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class ImageResolver:
    """Turns a request's ``ImageInput``s into ``(offset, [num_tokens, hidden])`` embeddings."""

    vision: LoadedVision | None
    cache: EncoderCache
    num_images_encoded: int = 0
    num_cache_hits: int = 0

    def validate(self, prompt: Sequence[int], images: Sequence[ImageInput]) -> None:
        """InvalidRequestError (param ``messages``) unless each image sits on its placeholders."""
        if not images:
            return
        if self.vision is None:
            raise InvalidRequestError("this model does not take images", "messages")
        token, per_image = self.vision.image_token_id, self.vision.num_image_tokens
        end = 0
        for i, image in enumerate(images):
            span = prompt[image.offset : image.offset + image.num_tokens]
            if (
                image.num_tokens != per_image
                or image.offset < end
                or len(span) != per_image
                or any(t != token for t in span)
            ):
                raise InvalidRequestError(
                    f"image {i} does not sit on {per_image} placeholder tokens at {image.offset}",
                    "messages",
                )
            end = image.offset + image.num_tokens
        if sum(1 for t in prompt if t == token) != per_image * len(images):
            raise InvalidRequestError(
                f"the prompt's image placeholders do not match its {len(images)} images",
                "messages",
            )

    def resolve(self, images: Sequence[ImageInput]) -> list[tuple[int, torch.Tensor]]:
        """Embeddings of every image: given, cached, or encoded now (in one batch)."""
        assert self.vision is not None or not images
        found: dict[int, torch.Tensor] = {}
        to_encode: list[int] = []
        for i, image in enumerate(images):
            cached = self.cache.get(image.content_hash)
            if image.embeddings is not None:
                found[i] = image.embeddings
            elif cached is not None:
                found[i] = cached
                self.num_cache_hits += 1
            elif image.data is not None:
                to_encode.append(i)
            else:
                raise InvalidRequestError(
                    f"image {i} carries neither its data nor its embeddings", "messages"
                )
        if to_encode:
            assert self.vision is not None
            pixels = [_decode(images[i].data or b"", i) for i in to_encode]
            encoded = self.vision.encode(pixels)
            for i, embeds in zip(to_encode, encoded):
                found[i] = embeds
                self.cache.put(images[i].content_hash, embeds)
            self.num_images_encoded += len(to_encode)
        out = []
        for i, image in enumerate(images):
            embeds = found[i]
            if self.vision is not None:
                embeds = embeds.to(self.vision.encoder.multi_modal_projector.linear_1.weight)
            out.append((image.offset, embeds))
        return out


def _decode(data: bytes, index: int) -> object:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(f"image {index} cannot be decoded: {e}", "messages") from e
    return image


def image_embeds_for_step(scheduled: Sequence[ScheduledRequest]) -> list[tuple[int, torch.Tensor]]:
    """``(row, embeddings)`` pieces of this step's flat batch that are image positions.

    A prefill chunk may cut an image: only the part inside ``[start, start + n)`` is placed.
    """
    pieces: list[tuple[int, torch.Tensor]] = []
    row = 0
    for item in scheduled:
        r: Request = item.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + item.num_new_tokens
        for offset, embeds in r.image_embeds:
            lo, hi = max(offset, start), min(offset + embeds.shape[0], end)
            if lo < hi:
                pieces.append((row + lo - start, embeds[lo - offset : hi - offset]))
        row += item.num_new_tokens
    return pieces
