"""A token's own bytes, for the ``bytes`` fields of logprobs.

A token that is part of a multi-byte UTF-8 character (a byte-level BPE token, a
SentencePiece byte-fallback token ``<0xC8>``) decodes on its own to U+FFFD, whose
UTF-8 bytes say nothing about the token; clients rebuild text from ``bytes``, so
those tokens answer with the raw bytes the tokenizer's vocabulary gives them.
Every other token's bytes are its decoded text's UTF-8.
"""

from __future__ import annotations

import functools
import re

from services.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["token_bytes"]

_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Tokenizer, token_id: int, text: str | None = None) -> bytes:
    """The bytes of ``token_id``; ``text`` is its decoded text, if already at hand."""
    if text is None:
        text = tokenizer.decode([token_id])
    if _REPLACEMENT not in text:
        return text.encode()
    raw: bytes | None = None
    if isinstance(tokenizer, ByteTokenizer) and 0 <= token_id < 256:
        raw = bytes([token_id])
    elif isinstance(tokenizer, HFTokenizer):
        raw = _vocab_bytes(tokenizer.hf_tokenizer.convert_ids_to_tokens(token_id))
    return text.encode() if raw is None else raw


def _vocab_bytes(piece: object) -> bytes | None:
    """The bytes a vocabulary entry stands for, where it is a byte token."""
    if not isinstance(piece, str) or not piece:
        return None
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    # Byte-level BPE (GPT-2 and its descendants) spells each byte as one printable
    # character; a piece made only of those is those bytes.
    decoder = _byte_level_decoder()
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return None


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` table, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}
