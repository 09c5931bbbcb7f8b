"""Baton's request as vLLM's parameters, and vLLM's logprobs back as Baton's.

Sampling is translated for tokens only (the gateway owns text) and delta outputs;
a request continued after a failover counts what it already generated against
``max_tokens`` and ``min_tokens``.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from services.engine.messages import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)

__all__ = [
    "prompt_token_logprobs",
    "refused_field",
    "remote_decode_params",
    "sampling_params",
    "structured_params",
    "token_logprobs",
]


def sampling_params(
    s: SamplingParams,
    num_known: int,
    num_tokens: int,
    prefill_only: bool,
    max_model_len: int,
    *,
    continued: bool = False,
) -> Any:
    """``s`` as vLLM's ``SamplingParams`` for a request with ``num_known`` outputs
    already generated and ``num_tokens`` tokens in all; tokens only (no text), in deltas.
    ``continued``: its first token came from elsewhere (a decode continuation, whose own
    known outputs leave that token out, or a failover)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    remaining = s.max_tokens - num_known
    if remaining <= 0:
        raise InvalidRequestError("max_tokens already reached", "max_tokens")
    remaining = min(remaining, max_model_len - num_tokens)
    max_tokens = 1 if prefill_only else remaining
    return VllmSamplingParams(
        n=1,
        max_tokens=max_tokens,
        min_tokens=0 if prefill_only else max(0, min(s.min_tokens - num_known, max_tokens)),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        # A continuation's prompt logprobs went out with its first token, elsewhere (a
        # decode continuation's prompt KV is pulled: vLLM has no logits to score it by).
        prompt_logprobs=None if continued or num_known else s.prompt_logprobs,
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        structured_outputs=structured_params(s.structured, num_known),
        logit_bias=dict(s.logit_bias) or None,
    )


def structured_params(so: StructuredOutput | None, num_known: int) -> Any:
    """Baton's backend-neutral constraint as vLLM's StructuredOutputsParams.

    vLLM starts a grammar at the first token it generates: a continuation sent as
    prompt + tokens so far (after a failover) would restart it, so it is refused
    here rather than produce text outside the grammar.
    """
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if num_known:
        raise InvalidRequestError(
            "the vllm backend cannot resume a constrained request mid-output", so.param
        )
    match so.kind:
        case "json":
            fields: dict[str, Any] = {"json": so.spec}
        case "json_object":
            fields = {"json_object": True}
        case "choice":
            fields = {"choice": json.loads(so.spec)}
        case _:
            fields = {so.kind: so.spec}
    return StructuredOutputsParams(disable_any_whitespace=not so.any_whitespace, **fields)


def remote_decode_params() -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def token_logprobs(
    entries: Sequence[Mapping[int, Any]], token_ids: Sequence[int]
) -> tuple[TokenLogprob, ...]:
    result = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(token_id)
        top = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1])
        result.append(
            TokenLogprob(
                token_id=token_id,
                logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
                top=tuple(top),
            )
        )
    return tuple(result)


def prompt_token_logprobs(
    entries: Sequence[Mapping[int, Any] | None], prompt_token_ids: Sequence[int]
) -> tuple[TokenLogprob, ...]:
    """vLLM's ``prompt_logprobs`` (None for token 0, then one entry per prompt token) as
    Baton's: prompt tokens 1..P-1."""
    return token_logprobs([e or {} for e in entries[1:]], prompt_token_ids[1:])


def refused_field(error: BaseException, sampling: SamplingParams) -> str | None:
    """The request field a vLLM refusal is about, where it can be told: the output
    constraint's (``response_format`` or ``structured_outputs``) when the refusal came
    from vLLM's structured-output code (a grammar, regex or schema it cannot compile)."""
    structured = sampling.structured
    if structured is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if any("structured_output" in f.name or "structured_output" in f.filename for f in frames):
        return structured.param
    return None
