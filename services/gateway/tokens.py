"""Tokenizing at the gateway: chat template, prompts to token ids."""

from __future__ import annotations

from typing import Any

from services.engine.tokenizer import Tokenizer

__all__ = ["Tokenizer", "chat_prompt_ids", "text_prompt_ids"]


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[int, ...]:
    # The template already places any BOS; encoding must not add a second one.
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


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
