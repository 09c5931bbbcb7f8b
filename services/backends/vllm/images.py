"""Images through vLLM's own multimodal path (LLaVA).

The gateway sends a request's prompt with each image's placeholder run expanded (the
length the router prices) and the image files. vLLM expands placeholders itself, from
one image token per image: ``vllm_image_prompt`` folds each run back to its first
token, and hands vLLM either the files decoded (vLLM's processor, from the checkpoint's
own processor config, resizes, crops, normalises and encodes them on this worker) or,
for images pulled from encode workers, their embeddings, which vLLM places as they are
(``enable_mm_embeds``). vLLM's prompt is then as long as ours.

vLLM 0.32's ``llava.py`` imports ``pixtral.py``, which imports one helper
(``_num_image_tokens``) from ``transformers``' torchvision image processor for Pixtral.
The CPU build here has no torchvision that loads (the registries' wheel is a CUDA
build), so ``allow_llava_without_torchvision`` points that module's name at
transformers' PIL twin of it, which defines the same helper; LLaVA's own processing
never touches torchvision. vLLM inspects a model class in a fresh interpreter, which
would not see that alias: with torchvision absent (a CPU build, so no CUDA to keep
uninitialised) the inspection runs in this process instead. Where torchvision
imports, nothing is changed.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from services.engine.messages import ImageInput, InvalidRequestError

__all__ = ["allow_llava_without_torchvision", "vllm_image_prompt"]

_T = TypeVar("_T")
_PIXTRAL = "transformers.models.pixtral.image_processing_pixtral"
_PIXTRAL_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"


def allow_llava_without_torchvision() -> bool:
    """Let vLLM load LLaVA where torchvision is absent (see the module); True if it did
    anything. Call before vLLM inspects the model."""
    if importlib.util.find_spec("torchvision") is not None or _PIXTRAL in sys.modules:
        return False
    sys.modules[_PIXTRAL] = importlib.import_module(_PIXTRAL_PIL)
    from vllm.model_executor.models import registry

    def in_process(fn: Callable[[], _T]) -> _T:
        return fn()

    registry._run_in_subprocess = in_process
    return True


def vllm_image_prompt(prompt: Sequence[int], images: Sequence[ImageInput]) -> tuple[list[int], Any]:
    """``prompt`` with each image's placeholder run folded to its first token, and what
    vLLM takes for the images, in prompt order: their embeddings stacked
    ``[N, tokens, hidden]`` where every image carries them (pulled from encode workers),
    else the files decoded. InvalidRequestError if an image has neither, or its run is
    not where it says."""
    ordered = sorted(images, key=lambda i: i.offset)
    tokens = _folded(prompt, ordered)
    embeddings = [image.embeddings for image in ordered]
    if ordered and all(e is not None for e in embeddings):
        import torch

        return tokens, torch.stack([e for e in embeddings if e is not None])
    return tokens, [_decoded(image) for image in ordered]


def _folded(prompt: Sequence[int], ordered: Sequence[ImageInput]) -> list[int]:
    tokens: list[int] = []
    start = 0
    for image in ordered:
        end = image.offset + image.num_tokens
        run = prompt[image.offset : end]
        if (
            image.offset < start
            or image.num_tokens < 1
            or len(set(run)) != 1
            or len(run) != image.num_tokens
        ):
            raise InvalidRequestError(
                f"image at prompt position {image.offset}: its {image.num_tokens} "
                "placeholder tokens are not there",
                "messages",
            )
        tokens.extend(prompt[start : image.offset])
        tokens.append(prompt[image.offset])
        start = end
    tokens.extend(prompt[start:])
    return tokens


def _decoded(image: ImageInput) -> Any:
    from PIL import Image

    if image.data is None:
        raise InvalidRequestError(
            f"image at prompt position {image.offset} has neither data nor embeddings", "messages"
        )
    try:  # the gateway checked the files; this guards a request made elsewhere
        with Image.open(io.BytesIO(image.data)) as file:
            file.load()
            return file.copy()
    except (OSError, ValueError) as e:
        raise InvalidRequestError(
            f"image at prompt position {image.offset} does not decode: {e}", "messages"
        ) from e
