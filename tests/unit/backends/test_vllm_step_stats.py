"""What the vLLM backend reports of a step and of its queue, from vLLM's scheduled
requests: the prompt tokens and decodes a step ran and the image encodes inside it (vLLM
encodes an image in the step whose chunk reaches its first placeholder), and the image
tokens its waiting prompts will still encode. The scheduled requests here are fakes of
vLLM's (only the fields the backend reads)."""

from __future__ import annotations

from dataclasses import dataclass

from services.backends.vllm.steps import images_to_encode, step_stats


@dataclass
class FakeScheduled:
    """vLLM's scheduler request, as far as the backend reads it."""

    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int


# Two images of 16 tokens at positions 4 and 40 of a 60-token prompt.
ENCODES = {"img-ab12": ((4, 16), (40, 16))}


def test_an_image_counts_in_the_step_whose_chunk_reaches_its_first_placeholder() -> None:
    # Chunks of 32 tokens: [0, 32) reaches the first image, [32, 60) the second.
    first = step_stats(
        [FakeScheduled("img-ab12", 32, 60), FakeScheduled("txt-cd34", 11, 10)],
        {"img-ab12": 0, "txt-cd34": 10},
        {"img-ab12": 60, "txt-cd34": 10},
        ENCODES,
        0.5,
        7.0,
    )
    assert first is not None
    assert (first.num_prefill_tokens, first.num_decode_seqs) == (32, 1)
    assert (first.num_encodes, first.num_encoded_image_tokens) == (1, 16)
    assert (first.total_context_tokens, first.duration_s, first.end_s) == (43, 0.5, 7.0)
    second = step_stats(
        [FakeScheduled("img-ab12", 60, 60)], {"img-ab12": 32}, {"img-ab12": 60}, ENCODES, 0.4, 8.0
    )
    assert second is not None
    assert (second.num_prefill_tokens, second.num_encodes, second.num_encoded_image_tokens) == (
        28,
        1,
        16,
    )


def test_one_chunk_over_both_images_is_one_encode_of_both() -> None:
    step = step_stats(
        [FakeScheduled("img-ab12", 60, 60)], {"img-ab12": 0}, {"img-ab12": 60}, ENCODES, 1.0, 1.0
    )
    assert step is not None
    assert (step.num_encodes, step.num_encoded_image_tokens) == (1, 32)


def test_a_request_vllm_does_not_encode_here_counts_no_encode() -> None:
    # Its images came as an encode worker's embeddings, or its KV is pulled: not in ENCODES.
    step = step_stats(
        [FakeScheduled("emb-ef56", 60, 60)], {"emb-ef56": 0}, {"emb-ef56": 60}, ENCODES, 1.0, 1.0
    )
    assert step is not None
    assert (step.num_prefill_tokens, step.num_encodes, step.num_encoded_image_tokens) == (60, 0, 0)


def test_a_step_that_computed_nothing_is_no_step() -> None:
    running = [FakeScheduled("img-ab12", 32, 60)]
    assert step_stats(running, {"img-ab12": 32}, {"img-ab12": 60}, ENCODES, 0.1, 1.0) is None


def test_waiting_prompts_report_the_images_their_prefill_has_not_reached() -> None:
    queue = [
        FakeScheduled("img-ab12", 0, 60),  # both images to come
        FakeScheduled("img-2", 32, 60),  # its first image encoded, the second to come
        FakeScheduled("txt-cd34", 0, 10),  # no images
    ]
    encodes = {**ENCODES, "img-2": ENCODES["img-ab12"]}
    assert images_to_encode(queue, encodes) == (32, 16)
    assert images_to_encode([FakeScheduled("img-ab12", 60, 60)], ENCODES) == ()
