"""Image preprocessing as a checkpoint's ``preprocessor_config.json`` says, offline (PIL + numpy).

The steps and their arithmetic are those of Hugging Face's PIL-backed CLIP and LLaVA
image processors, so pixel values match ``transformers`` exactly: convert to RGB,
pad to a square (LLaVA's ``do_pad``, filled with the mean colour), resize (the shortest
edge, or to a fixed height and width) with PIL's filter, centre-crop (zero-padding
an image that is too small), rescale in float64 then float32, normalise per channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.engine.messages import UnsupportedModelError

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["SUPPORTED_IMAGE_PROCESSORS", "ImageProcessor"]

SUPPORTED_IMAGE_PROCESSORS = ("CLIPImageProcessor", "LlavaImageProcessor")
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True, slots=True)
class ImageProcessor:
    shortest_edge: int | None  # resize so the shorter side is this long (aspect kept)
    resize_hw: tuple[int, int] | None  # or resize to exactly (height, width)
    crop_hw: tuple[int, int] | None  # centre crop to (height, width); None: no crop
    rescale_factor: float | None  # pixel values x this (1/255); None: no rescale
    image_mean: tuple[float, ...] | None  # None: no normalisation
    image_std: tuple[float, ...] | None
    resample: int = _BICUBIC  # a PIL filter number
    pad_to_square: bool = False
    convert_rgb: bool = True

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ImageProcessor:
        kind = str(cfg.get("image_processor_type") or "CLIPImageProcessor")
        base = kind.removesuffix("Fast").removesuffix("Pil")
        if base not in SUPPORTED_IMAGE_PROCESSORS:
            raise UnsupportedModelError(
                f"image processor {kind!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_IMAGE_PROCESSORS)}"
            )
        size = cfg.get("size", {"shortest_edge": 224}) if cfg.get("do_resize", True) else None
        shortest = resize_hw = None
        match size:
            case None:
                pass
            case int():
                shortest = size
            case {"shortest_edge": int(edge)}:
                shortest = edge
            case {"height": int(h), "width": int(w)}:
                resize_hw = (h, w)
            case _:
                raise UnsupportedModelError(f"image processor size {size!r} is not supported")
        crop = cfg.get("crop_size", 224) if cfg.get("do_center_crop", True) else None
        crop_hw = (crop, crop) if isinstance(crop, int) else None
        if isinstance(crop, dict):
            crop_hw = (int(crop["height"]), int(crop["width"]))
        normalize = cfg.get("do_normalize", True)
        return cls(
            shortest_edge=shortest,
            resize_hw=resize_hw,
            crop_hw=crop_hw,
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255))
            if cfg.get("do_rescale", True)
            else None,
            image_mean=tuple(cfg.get("image_mean", _CLIP_MEAN)) if normalize else None,
            image_std=tuple(cfg.get("image_std", _CLIP_STD)) if normalize else None,
            resample=int(cfg.get("resample", _BICUBIC)),
            pad_to_square=bool(cfg.get("do_pad", False)) and base == "LlavaImageProcessor",
            convert_rgb=bool(cfg.get("do_convert_rgb", True)),
        )

    def output_hw(self) -> tuple[int, int] | None:
        """The (height, width) of every output, when it does not depend on the input."""
        return self.crop_hw or self.resize_hw

    def preprocess(self, images: Sequence[Image]) -> torch.Tensor:
        """Images -> pixel values ``[N, 3, H, W]`` float32."""
        return torch.from_numpy(np.stack([self._one(image) for image in images]))

    def _one(self, image: Image) -> np.ndarray:
        if self.convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.pad_to_square and image.width != image.height:
            image = self._padded(image)
        if self.resize_hw is not None or self.shortest_edge is not None:
            height, width = self.resize_hw or _shortest_edge_hw(
                image.height, image.width, self.shortest_edge or 0
            )
            image = image.resize((width, height), resample=self.resample)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        chw = pixels.transpose(2, 0, 1)
        if self.crop_hw is not None:
            chw = _center_crop(chw, self.crop_hw)
        out = chw.astype(np.float32)
        if self.rescale_factor is not None:
            out = (chw.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.image_mean is not None and self.image_std is not None:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return np.ascontiguousarray(out, dtype=np.float32)

    def _padded(self, image: Image) -> Image:
        from PIL import Image as PILImage

        side = max(image.width, image.height)
        fill = tuple(int(m * 255) for m in (self.image_mean or (0.0, 0.0, 0.0)))
        square = PILImage.new("RGB", (side, side), fill)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return square


def _shortest_edge_hw(height: int, width: int, edge: int) -> tuple[int, int]:
    # torchvision's rule, as transformers applies it: the long side truncates.
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def _center_crop(chw: np.ndarray, crop_hw: tuple[int, int]) -> np.ndarray:
    _, height, width = chw.shape
    crop_h, crop_w = crop_hw
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return chw[:, top : top + crop_h, left : left + crop_w]
    # Too small: zero-pad to at least the crop, centred (rounding up), then crop.
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((chw.shape[0], new_h, new_w), dtype=chw.dtype)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[:, pad_top : pad_top + height, pad_left : pad_left + width] = chw
    top, left = top + pad_top, left + pad_left
    return padded[:, top : top + crop_h, left : left + crop_w]
