"""Which requests the engine accepts: one ``EngineRequest`` checked against its model.

Its own idea beside the step: pure checks of a message against the model's vocabulary
and context length, each failure an ``InvalidRequestError`` naming the field (the
client's 400), read and changed apart from the engine's state. The checks that need
that state stay in ``LLMEngine._admit``: a duplicate request id before these, the
images (the vision tower's) after.
"""

from __future__ import annotations

from services.engine.messages import EngineRequest, InvalidRequestError

__all__ = ["validate_request"]


def validate_request(message: EngineRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise ``InvalidRequestError`` naming the first bad field of ``message``."""
    message.sampling.validate()
    prompt = message.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if any(not 0 <= t < vocab_size for t in (*prompt, *message.output_token_ids)):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", "prompt")
    if message.sampling.top_k > vocab_size:
        raise InvalidRequestError(
            f"top_k must be at most the vocabulary size ({vocab_size}), or -1/0 for off",
            "top_k",
        )
    if any(not 0 <= t < vocab_size for t in message.sampling.stop_token_ids):
        raise InvalidRequestError(f"stop token ids must be in [0, {vocab_size})", "stop_token_ids")
    if any(not 0 <= t < vocab_size for t, _ in message.sampling.logit_bias):
        raise InvalidRequestError(
            f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias"
        )
    num_tokens = len(prompt) + len(message.output_token_ids)
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num_tokens} tokens; this model's context is "
            f"{max_model_len} (at least one must be left to generate)",
            "prompt",
        )
    if len(message.output_token_ids) >= message.sampling.max_tokens:
        raise InvalidRequestError("max_tokens already reached by the given outputs", "max_tokens")
