"""The vLLM backend's image prompt: the gateway's expanded placeholder runs folded back to
one image token each (vLLM expands them itself), images decoded in prompt order."""

from __future__ import annotations

import pytest
import torch

from services.backends.vllm.images import vllm_image_prompt
from services.engine.messages import ImageInput, InvalidRequestError
from tests.unit.engine.llava_twin import png_bytes, random_image

IMG = 95


def _image(offset: int, n: int, seed: int, width: int = 8) -> ImageInput:
    return ImageInput(f"h{seed}", offset, n, data=png_bytes(random_image(seed, width, 4)))


def test_each_run_folds_to_one_token_and_images_keep_prompt_order() -> None:
    prompt = [5, IMG, IMG, IMG, 6, IMG, IMG, IMG, IMG, IMG, IMG, 7]  # 3 + two adjacent runs of 3
    images = [_image(8, 3, 2, width=9), _image(1, 3, 1), _image(5, 3, 3, width=10)]
    tokens, decoded = vllm_image_prompt(prompt, images)
    assert tokens == [5, IMG, 6, IMG, IMG, 7]
    assert [im.size for im in decoded] == [(8, 4), (10, 4), (9, 4)]


def test_text_only_prompt_is_unchanged() -> None:
    assert vllm_image_prompt([1, 2, 3], []) == ([1, 2, 3], [])


@pytest.mark.parametrize(
    "images",
    [
        [ImageInput("h", 1, 3)],  # no data: an encode worker's embeddings, not for vLLM
        [_image(1, 4, 1)],  # the run is shorter than the image says
        [_image(0, 3, 1)],  # not a placeholder run
        [_image(1, 3, 1), _image(2, 3, 2)],  # overlapping
        [ImageInput("h", 1, 3, data=b"\x89PNG\r\n\x1a\n")],  # a truncated PNG
    ],
    ids=["no_data", "short_run", "not_placeholders", "overlap", "undecodable"],
)
def test_misplaced_or_dataless_images_are_invalid_requests(images: list[ImageInput]) -> None:
    with pytest.raises(InvalidRequestError):
        vllm_image_prompt([5, IMG, IMG, IMG, 6], images)


def test_pulled_embeddings_go_to_vllm_stacked_in_prompt_order() -> None:
    """Images pulled from encode workers carry embeddings and no data: vLLM gets them
    as precomputed image embeddings, [N, tokens, hidden]."""
    first, second = torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)
    images = [ImageInput("b", 5, 3, embeddings=second), ImageInput("a", 1, 3, embeddings=first)]
    tokens, embeds = vllm_image_prompt([5, IMG, IMG, IMG, 6, IMG, IMG, IMG], images)
    assert tokens == [5, IMG, 6, IMG]
    assert torch.equal(embeds, torch.stack([first, second]))
