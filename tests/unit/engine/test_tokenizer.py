"""The byte tokenizer and the incremental detokenizer (UTF-8 splits, stop strings)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from services.engine.loader import load_tokenizer
from services.engine.tokenizer import ByteTokenizer, Tokenizer
from services.gateway.detokenizer import IncrementalDetokenizer
from tests.unit.engine.conftest import HFCheckpoint

TOK = ByteTokenizer()


def _stream(
    tok: Tokenizer, prompt: Sequence[int], output: Sequence[int], **kw: object
) -> tuple[list[str], bool, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, **kw)  # type: ignore[arg-type]
    chunks = []
    stopped = False
    for t in output:
        text, stopped = detok.add(t)
        chunks.append(text)
        if stopped:
            break
    return chunks, stopped, detok


def test_byte_tokenizer_round_trips_and_parses_specials() -> None:
    text = "héllo wörld 😀"
    ids = TOK.encode(text)
    assert ids[0] == TOK.BOS and len(ids) == 1 + len(text.encode())
    assert TOK.decode(ids) == text
    ids = TOK.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids == [TOK.IM_START, *b"user\nhi", TOK.IM_END]
    assert TOK.decode(ids) == "user\nhi"
    assert TOK.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert TOK.IM_END in TOK.eos_token_ids


def test_byte_tokenizer_chat_template() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert TOK.apply_chat_template(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not TOK.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_multibyte_characters_split_across_tokens() -> None:
    text = "né 😀 ok"
    output = TOK.encode(text, add_special_tokens=False)
    chunks, stopped, detok = _stream(TOK, TOK.encode("q"), output)
    assert not stopped
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    emoji_at = len("né ".encode())
    assert chunks[emoji_at : emoji_at + 4] == ["", "", "", "😀"]
    assert detok.finish() == ""


def test_stop_string_across_tokens_stops_and_truncates() -> None:
    output = TOK.encode("Hello STOP world", add_special_tokens=False)
    chunks, stopped, detok = _stream(TOK, [], output, stop=("STOP",))
    assert stopped
    assert "".join(chunks) == "Hello "
    assert len(chunks) == len("Hello STOP")  # stopped on the token that completed it
    assert detok.add(ord("x")) == ("", True)
    assert detok.finish() == ""


def test_stop_string_included_when_asked() -> None:
    output = TOK.encode("Hello STOP world", add_special_tokens=False)
    chunks, stopped, _ = _stream(TOK, [], output, stop=("STOP",), include_stop_str_in_output=True)
    assert stopped and "".join(chunks) == "Hello STOP"


def test_possible_stop_prefix_is_held_back_until_disambiguated() -> None:
    chunks, stopped, detok = _stream(TOK, [], b"xab", stop=("abc",))
    assert chunks == ["x", "", ""] and not stopped
    text, stopped = detok.add(ord("d"))
    assert (text, stopped) == ("abd", False)
    chunks, _, detok = _stream(TOK, [], b"xab", stop=("abc",))
    assert detok.finish() == "ab"  # the request ended for another reason: flush


def test_earliest_stop_string_wins_and_multibyte_stop() -> None:
    chunks, stopped, _ = _stream(TOK, [], "a: é! b;".encode(), stop=(";", "é!"))
    assert stopped and "".join(chunks) == "a: "


def test_incomplete_utf8_is_flushed_by_finish() -> None:
    chunks, _, detok = _stream(TOK, [], b"ok\xf0\x9f")
    assert "".join(chunks) == "ok"
    assert detok.finish() == "\ufffd"


@pytest.mark.parametrize("prompt_len", [0, 3])
def test_hf_tokenizer_stream_matches_full_decode(
    hf_checkpoint: Callable[[str], HFCheckpoint], prompt_len: int
) -> None:
    tok = load_tokenizer(str(hf_checkpoint("llama").folder))
    prompt = tok.encode("the cat sat", add_special_tokens=False)[:prompt_len]
    output = tok.encode("on a mat hello world", add_special_tokens=False)
    chunks, _, detok = _stream(tok, prompt, output)
    full, prefix = tok.decode([*prompt, *output]), tok.decode(prompt)
    assert "".join(chunks) + detok.finish() == full[len(prefix) :]
    assert chunks[1] == " a"
