"""Incremental detokenization with stop strings, one instance per request.

Text is produced by decoding a short window of recent tokens and diffing it
against the same window without the newest token, so tokenizers whose pieces
depend on their neighbours (leading spaces, byte fallback) come out right.
Text is held back while it:

* ends in an incomplete UTF-8 sequence (the decoder renders it as U+FFFD), or
* ends with something that could be the start of a stop string.

Call ``add`` for every generated token and ``finish`` once when the request
ends for another reason (EOS, length, abort) to flush what was held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the first output tokens


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # tokens before this are already in _text
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._text = ""  # all output text decoded so far
        self._num_emitted_chars = 0
        self._stopped = False
        self._prefix_cache: tuple[tuple[int, int], str] = ((-1, -1), "")

    @property
    def text(self) -> str:
        """All output text decoded so far (including what is held back)."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one generated token; return (text to emit now, stopped by a stop string)."""
        if self._stopped:
            return "", True
        self._ids.append(token_id)
        previous_len = len(self._text)
        self._text += self._decode_new_text()
        return self._emit(search_from=previous_len)

    def finish(self) -> str:
        """Text still held back, to emit when the request ends without a stop string."""
        if self._stopped:
            return ""
        tail = self._tokenizer.decode(self._ids[self._prefix_offset :])
        prefix = self._prefix_text()
        self._text += tail[len(prefix) :]
        self._read_offset = self._prefix_offset = len(self._ids)
        out = self._text[self._num_emitted_chars :]
        self._num_emitted_chars = len(self._text)
        return out

    def _decode_new_text(self) -> str:
        prefix = self._prefix_text()
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a multi-byte character still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _prefix_text(self) -> str:
        """The decoded window before the unread tokens; unchanged while text is held back."""
        window = (self._prefix_offset, self._read_offset)
        if self._prefix_cache[0] != window:
            self._prefix_cache = (window, self._tokenizer.decode(self._ids[slice(*window)]))
        return self._prefix_cache[1]

    def _emit(self, search_from: int) -> tuple[str, bool]:
        stop_at = self._find_stop(search_from)
        if stop_at is not None:
            self._stopped = True
            end = stop_at
        else:
            end = len(self._text) - self._partial_stop_len()
        end = max(end, self._num_emitted_chars)
        out = self._text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return out, self._stopped

    def _find_stop(self, search_from: int) -> int | None:
        """End of the emitted text if a stop string now appears, else None."""
        best: tuple[int, int] | None = None  # (start, length) of the earliest match
        for s in self._stop:
            i = self._text.find(s, max(0, search_from - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + best[1] if self._include_stop else best[0]

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest
