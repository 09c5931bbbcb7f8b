"""OpenAI response bodies and SSE chunks, built as plain dicts (fast to serialise).

Chat streams: the first chunk of each choice carries ``delta: {role, content: ""}``,
then content deltas, the last with ``finish_reason``. With
``stream_options.include_usage`` every chunk has ``usage: null`` and one final
chunk has ``choices: []`` and the usage. Completions streams carry
``choices[].text``. The stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.engine.messages import TokenLogprob
from services.gateway.token_bytes import token_bytes
from services.gateway.tokens import Tokenizer

__all__ = ["DONE", "Endpoint", "Formatter", "LogprobsAcc", "sse", "usage"]

Endpoint = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
) -> dict[str, Any]:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens``: the prompt tokens
    served from a prefix cache."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def _finish(reason: str | None) -> str | None:
    # The engine's reasons are OpenAI's, except ``abort`` (never sent for a finished
    # request) and ``prefilled`` (internal to disaggregation).
    if reason in ("stop", "length", "tool_calls"):
        return reason
    return None if reason is None else "stop"


@dataclass(frozen=True, slots=True)
class _Entry:
    """One token as the logprobs fields show it."""

    token_id: int
    text: str
    logprob: float | None  # None: an echoed prompt's first token (nothing before it)
    raw: bytes  # the token's own bytes (token_bytes.py), not ``text`` re-encoded


@dataclass(slots=True)
class LogprobsAcc:
    """Logprobs of one choice: accumulated and rendered once (non-streaming), or
    rendered per chunk with ``take`` (streaming).

    ``chars`` is the character offset of the next token in the choice's returned text,
    so ``text_offset`` runs on across chunks; an echoed prompt starts it at the
    prompt text's length.
    """

    endpoint: Endpoint
    chars: int = 0
    tokens: list[_Entry] = field(default_factory=list)
    top: list[list[_Entry] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> None:
        for lp in logprobs:
            self._append(
                _entry(tokenizer, lp.token_id, lp.logprob),
                [_entry(tokenizer, t, v) for t, v in lp.top],
            )

    def add_prompt(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None,
    ) -> None:
        """An echoed prompt's tokens, before the output's: the first (nothing before
        it) with a null logprob and null alternatives, as OpenAI shows it; the others
        as ``logprobs`` (prompt tokens 1.. from the engine; null where it sent none)."""
        for i, token_id in enumerate(prompt_token_ids):
            lp = logprobs[i - 1] if logprobs is not None and 0 < i <= len(logprobs) else None
            if lp is None:
                self._append(_entry(tokenizer, token_id, None), None)
            else:
                self.add(tokenizer, (lp,))

    def _append(self, entry: _Entry, top: list[_Entry] | None) -> None:
        self.tokens.append(entry)
        self.top.append(top)
        self.text_offset.append(self.chars)
        self.chars += len(entry.text)

    def take(self) -> dict[str, Any]:
        """Render the tokens added since the last ``take`` and forget them (not ``chars``)."""
        out = self.render()
        self.tokens, self.top, self.text_offset = [], [], []
        return out

    def render(self) -> dict[str, Any]:
        if self.endpoint == "completion":
            return {
                "tokens": [e.text for e in self.tokens],
                "token_logprobs": [e.logprob for e in self.tokens],
                "top_logprobs": [
                    None if top is None else _top_dict(e, top)
                    for e, top in zip(self.tokens, self.top)
                ],
                "text_offset": self.text_offset,
            }
        return {
            "content": [
                {
                    **_chat_entry(e),
                    "top_logprobs": [_chat_entry(t) for t in top or ()],
                }
                for e, top in zip(self.tokens, self.top)
            ]
        }


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> _Entry:
    text = tokenizer.decode([token_id])
    return _Entry(token_id, text, logprob, token_bytes(tokenizer, token_id, text))


def _chat_entry(e: _Entry) -> dict[str, Any]:
    return {"token": e.text, "logprob": e.logprob, "bytes": list(e.raw)}


def _top_dict(sampled: _Entry, top: Sequence[_Entry]) -> dict[str, float | None]:
    # Completions key top_logprobs by token text, so different tokens with the same text
    # (byte tokens that all show as U+FFFD) collide. Each text keeps its first, most
    # likely, token's logprob, except that the sampled token's text, when the sampled
    # token is among them, keeps the sampled token's own logprob: ``tokens[i]`` looked
    # up in ``top_logprobs[i]`` gives ``token_logprobs[i]``.
    out: dict[str, float | None] = {}
    for t in top:
        out.setdefault(t.text, t.logprob)
    if any(t.token_id == sampled.token_id for t in top):
        out[sampled.text] = sampled.logprob
    return out


@dataclass(frozen=True, slots=True)
class Formatter:
    endpoint: Endpoint
    response_id: str
    created: int
    model: str
    include_usage: bool = False

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        *,
        first: bool = False,
        usage_now: dict[str, int] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.endpoint == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if not first and text:
                delta["content"] = text
            if reasoning:
                delta["reasoning"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
        choice["finish_reason"] = _finish(finish_reason)
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage or usage_now is not None:
            body["usage"] = usage_now
        return body

    def usage_chunk(self, usage_total: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_total,
        }

    def response(
        self,
        choices: Sequence[tuple[str, str | None, dict[str, Any] | None]],
        usage_total: dict[str, int],
        messages: Sequence[dict[str, Any] | None] = (),
    ) -> dict[str, Any]:
        """A non-streaming body from (text, finish_reason, logprobs) per choice.

        A chat choice's ``messages[i]``, when given, replaces the plain text message
        (reasoning, tool calls: see shaping.py).
        """
        rendered: list[dict[str, Any]] = []
        for index, (text, finish, logprobs) in enumerate(choices):
            if self.endpoint == "chat":
                shaped = messages[index] if index < len(messages) else None
                body = shaped or {"role": "assistant", "content": text}
                rendered.append(
                    {
                        "index": index,
                        "message": body,
                        "logprobs": logprobs,
                        "finish_reason": _finish(finish),
                    }
                )
            else:
                rendered.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": _finish(finish),
                    }
                )
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.endpoint == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": rendered,
            "usage": usage_total,
        }
