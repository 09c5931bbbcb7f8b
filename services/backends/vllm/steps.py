"""What the vLLM backend reports of vLLM's steps and queue, read off its scheduled
requests (``vllm.v1.request.Request``: ``request_id``, ``num_computed_tokens``,
``num_prompt_tokens``): the prompt tokens and decodes a step ran and the image encodes
inside it, and the image tokens its waiting prompts will still encode. vLLM encodes an
image given as a file in the step whose chunk reaches its first placeholder; the
router prices those encodes apart from the prefill (``router.cost_model``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.engine.messages import StepStats

__all__ = ["images_to_encode", "step_stats"]


def step_stats(
    running: Sequence[Any],
    before: dict[str, int],
    prompt_lens: dict[str, int],
    encodes: dict[str, tuple[tuple[int, int], ...]],
    duration_s: float,
    ended: float,
) -> StepStats | None:
    """The step vLLM just took, from its scheduled requests (``running``: vLLM's, as
    they are after the step) against their computed tokens before it (``before``) and their prompt
    lengths: the prompt tokens it computed, the sequences it decoded, their context, and
    the encodes it ran (``encodes``: by vLLM's id, (position, image tokens) of each
    image vLLM encodes for the request; an image runs in the step whose chunk reaches
    its first placeholder). None: it computed nothing."""
    prefill_tokens = decode_seqs = context = 0
    encoded: list[int] = []  # image tokens of each request whose images ran in the step
    for r in running:
        now = r.num_computed_tokens
        context += now
        was = before.get(r.request_id, 0)
        if now <= was:
            continue
        if was < prompt_lens.get(r.request_id, r.num_prompt_tokens):
            prefill_tokens += now - was
            tokens = sum(n for at, n in encodes.get(r.request_id, ()) if was <= at < now)
            if tokens:
                encoded.append(tokens)
        else:
            decode_seqs += 1
    if not prefill_tokens and not decode_seqs:
        return None
    return StepStats(
        duration_s, prefill_tokens, decode_seqs, context, ended, len(encoded), sum(encoded)
    )


def images_to_encode(
    requests: Sequence[Any], encodes: dict[str, tuple[tuple[int, int], ...]]
) -> tuple[int, ...]:
    """Per scheduled request (``requests``: vLLM's) with images it will still encode here
    (``encodes``: as ``step_stats`` takes them), their image tokens: the images whose
    first placeholder its prefill has not reached."""
    out = []
    for r in requests:
        done = r.num_computed_tokens
        tokens = sum(n for at, n in encodes.get(r.request_id, ()) if at >= done)
        if tokens:
            out.append(tokens)
    return tuple(out)
