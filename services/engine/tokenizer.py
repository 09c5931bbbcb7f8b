"""Tokenizers: the protocol the engine and gateway use, a Hugging Face wrapper and the byte tokenizer.

``ByteTokenizer`` belongs to the built-in ``tiny`` model: one token per UTF-8
byte (ids 0-255) plus a few specials, so any text round-trips and a multi-byte
character spans several tokens (which the incremental detokenizer must handle).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from services.engine.messages import InvalidRequestError, ModelLoadError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255, then the special tokens below."""

    SPECIALS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
    BOS, EOS, IM_START, IM_END, PAD = range(256, 256 + len(SPECIALS))
    IMAGE_PLACEHOLDER = ""  # what an image content part renders as in the chat template

    def __init__(self) -> None:
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self._special_re = re.compile("(" + "|".join(map(re.escape, self.SPECIALS)) + ")")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS, self.IM_END)

    @property
    def bos_token_id(self) -> int | None:
        return self.BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS] if add_special_tokens else []
        for piece in self._special_re.split(text):
            special = self._special_ids.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                pending.append(t)
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens and 256 <= t < self.vocab_size:
                parts.append(self.SPECIALS[t - 256])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        # ChatML, with tools and tool calls the way Qwen's (hermes-style) templates put them.
        text = ""
        if tools:
            listed = "\n".join(json.dumps(t, separators=(",", ":")) for t in tools)
            text = f"<|im_start|>system\n<tools>\n{listed}\n</tools><|im_end|>\n"
        for m in messages:
            body = _content_text(m.get("content"), self.IMAGE_PLACEHOLDER)
            for call in m.get("tool_calls") or ():
                fn = call.get("function", {})
                payload = {"name": fn.get("name"), "arguments": fn.get("arguments")}
                body += f"<tool_call>\n{json.dumps(payload, separators=(',', ':'))}\n</tool_call>"
            text += f"<|im_start|>{m['role']}\n{body}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _content_text(content: Any, image_placeholder: str = "") -> str:
    # OpenAI content is a string or a list of parts: text parts, and image parts that a
    # multimodal byte model marks with its placeholder (a text model drops them).
    match content:
        case None:
            return ""
        case str():
            return content
        case list():
            return "".join(
                p.get("text", "")
                if p.get("type") == "text"
                else image_placeholder
                if p.get("type") in ("image", "image_url")
                else ""
                for p in content
            )
        case _:
            raise InvalidRequestError(f"unsupported message content {type(content).__name__}")


class HFTokenizer:
    """A local Hugging Face tokenizer (``tokenizer.json`` and friends), loaded offline."""

    def __init__(self, path: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> None:
        from transformers import AutoTokenizer  # heavy import, only when a real model is loaded

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e
        eos = [] if self._tok.eos_token_id is None else [int(self._tok.eos_token_id)]
        self._eos = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped ``transformers`` tokenizer (grammar compilers read its vocabulary)."""
        return self._tok

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self._tok.chat_template:
            raise InvalidRequestError("this model has no chat template", "messages")
        return str(
            self._tok.apply_chat_template(
                messages,
                tools=tools or None,  # type: ignore[arg-type]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )
