"""Tokenizing at the gateway: chat template, prompts to token ids, token text for logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Tokenizer", "chat_prompt_ids", "text_prompt_ids"]


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> Any: ...


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]]) -> tuple[int, ...]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if isinstance(rendered, str):
        return tuple(tokenizer.encode(rendered))
    if isinstance(rendered, dict) and "input_ids" in rendered:  # a BatchEncoding
        rendered = rendered["input_ids"]
    return tuple(int(t) for t in rendered)


def text_prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[tuple[int, ...]]:
    """A completions ``prompt`` (text, texts, token ids, lists of token ids) as token ids."""
    match prompt:
        case str():
            return [tuple(tokenizer.encode(prompt))]
        case [] | [str(), *_]:
            return [tuple(tokenizer.encode(p)) for p in prompt if isinstance(p, str)]
        case [int(), *_]:
            return [tuple(t for t in prompt if isinstance(t, int))]
        case _:
            return [tuple(p) for p in prompt if isinstance(p, list)]
