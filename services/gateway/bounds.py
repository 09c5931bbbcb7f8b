"""Bounds on one request, checked at the door before any work (tokenizing, placing).

    check_bounds(body, config, vocab_size)
                                 400 naming the field when the request asks for more
                                 than ``gateway.*`` allows (prompts x n sequences, stop
                                 strings: count, length) or than the vocabulary holds
                                 (``top_k``; token ids of a prompt, of ``stop_token_ids``
                                 and of ``logit_bias`` keys; its values in [-100, 100])

The engine checks the model's own bounds again (token ids, the context length, its
vocabulary) and answers before the request's first byte, so those are 400s too. Body and header sizes are the HTTP layer's
(``services.gateway.app.BodyLimit``, ``services.gateway.connections``).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.config import GatewayConfig
from services.gateway.errors import BadRequest
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["check_bounds"]


_MAX_ABS_LOGIT_BIAS = 100.0


def check_bounds(
    body: ChatCompletionRequest | CompletionRequest, config: GatewayConfig, vocab_size: int
) -> None:
    _check_sequences(body, config.max_sequences_per_request)
    _check_stop(body, config.max_stop_strings, config.max_stop_string_chars)
    _check_vocab(body, vocab_size)


def _check_vocab(body: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> None:
    # An unbounded top_k reached the sampler as a 2^63 tensor size and killed a worker.
    if body.top_k is not None and body.top_k > vocab_size:
        raise BadRequest(
            f"top_k must be -1 or 0 (off) or at most the vocabulary size ({vocab_size}), "
            f"got {body.top_k}",
            "top_k",
        )
    # Token ids past the vocabulary: an embedding lookup out of range in the engine.
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        for row in prompt if isinstance(prompt[0], list) else [prompt]:
            _check_ids(row, vocab_size, "prompt")
    _check_ids(body.stop_token_ids or (), vocab_size, "stop_token_ids")
    for key, bias in (body.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys are token ids, got {key!r}", "logit_bias") from None
        _check_ids((token_id,), vocab_size, "logit_bias")
        if not -_MAX_ABS_LOGIT_BIAS <= bias <= _MAX_ABS_LOGIT_BIAS:  # NaN fails too
            raise BadRequest(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")


def _check_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A 400 naming ``param`` at the first id outside [0, ``vocab_size``)."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise BadRequest(
                f"{param} token ids must be in [0, {vocab_size}), got {token_id}", param
            )


def _check_sequences(body: ChatCompletionRequest | CompletionRequest, cap: int) -> None:
    prompt = getattr(body, "prompt", None)
    num_prompts = (
        len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    )
    if num_prompts * body.n > cap:
        raise BadRequest(
            f"{num_prompts} prompt(s) x n={body.n} = {num_prompts * body.n} sequences; "
            f"at most {cap} per request (gateway.max_sequences_per_request)",
            "n",
        )


def _check_stop(
    body: ChatCompletionRequest | CompletionRequest, max_strings: int, max_chars: int
) -> None:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stop) > max_strings:
        raise BadRequest(
            f"{len(stop)} stop strings; at most {max_strings} (gateway.max_stop_strings)", "stop"
        )
    longest = max((len(s) for s in stop), default=0)
    if longest > max_chars:
        raise BadRequest(
            f"a stop string of {longest} characters; at most {max_chars} "
            "(gateway.max_stop_string_chars)",
            "stop",
        )
