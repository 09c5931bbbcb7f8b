"""Prompt logprobs (vLLM's ``prompt_logprobs``; the OpenAI completions API's ``echo``
with ``logprobs``): the logprob of each prompt token given the ones before it, from
the logits of the position before it, as a step computes them.

A prompt runs in chunks, so each step adds the tokens its chunk reaches. Position
``p``'s logits score prompt token ``p + 1``: a chunk over positions ``[start, end)``
adds tokens ``start + 1 .. min(end, P - 1)``; the last prompt position's logits are
the first output's, sampled as usual. Token 0 has none. The values are the raw logits'
log-softmax (as ``logprobs`` reports them: before penalties, bias or a grammar).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.engine.messages import TokenLogprob
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest

__all__ = ["PromptSpan", "add_prompt_logprobs", "prompt_spans"]

_ROWS_AT_ONCE = 256  # logits rows per matmul: a long chunk's [rows, vocab] stays bounded


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Rows ``[first_row, first_row + count)`` of a step's hidden states score prompt
    tokens ``first_token .. first_token + count - 1`` of ``request``."""

    request: Request
    first_row: int
    first_token: int
    count: int


def prompt_spans(scheduled: Sequence[ScheduledRequest]) -> list[PromptSpan]:
    """The spans of this step (read before the step advances ``num_computed_tokens``;
    rows in the order ``build_step_inputs`` lays them out). Tokens already scored (a
    prompt recomputed after a preemption) are not scored again."""
    spans: list[PromptSpan] = []
    row = 0
    for item in scheduled:
        r, n = item.request, item.num_new_tokens
        if r.computes_prompt_logprobs:
            assert r.prompt_logprobs is not None
            start = r.num_computed_tokens
            first = max(start, len(r.prompt_logprobs))  # position scoring the next token
            end = min(start + n, r.num_prompt_tokens - 1)
            if start <= len(r.prompt_logprobs) and first < end:
                spans.append(PromptSpan(r, row + first - start, first + 1, end - first))
        row += n
    return spans


def add_prompt_logprobs(
    hidden: torch.Tensor,
    spans: Sequence[PromptSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Score each span's tokens from ``hidden`` [T, H] with ``compute_logits``
    ([N, H] -> [N, vocab] float32) and append them to its request's list."""
    for span in spans:
        r = span.request
        assert r.prompt_logprobs is not None
        num_top = r.sampling.prompt_logprobs or 0
        for lo in range(0, span.count, _ROWS_AT_ONCE):
            k = min(_ROWS_AT_ONCE, span.count - lo)
            rows = hidden[span.first_row + lo : span.first_row + lo + k]
            logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            first = span.first_token + lo
            targets = r.prompt_token_ids[first : first + k]
            chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
            values = chosen[:, 0].tolist()
            if num_top:
                top_values, top_ids = logprobs.topk(num_top, dim=-1)
                tops = [
                    tuple(zip(ids, vals))
                    for ids, vals in zip(top_ids.tolist(), top_values.tolist())
                ]
            else:
                tops = [()] * k
            r.prompt_logprobs.extend(
                TokenLogprob(token_id=t, logprob=v, top=top)
                for t, v, top in zip(targets, values, tops)
            )
