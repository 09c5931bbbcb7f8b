"""Logprobs fields: text_offset across chunks and after an echo, token bytes, top_logprobs keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.engine.messages import TokenLogprob
from services.engine.tokenizer import ByteTokenizer, HFTokenizer
from services.gateway.openai_format import LogprobsAcc
from services.gateway.token_bytes import token_bytes
from tests.unit.engine.conftest import save_byte_level_tokenizer
from tests.unit.gateway.conftest import MODEL

_REPLACEMENT = "\ufffd"


def _events(text: str) -> list[dict[str, Any]]:
    frames = [f[len("data: ") :] for f in text.split("\n\n") if f.startswith("data: {")]
    return [json.loads(f) for f in frames]


@pytest.mark.asyncio
async def test_text_offset_is_the_same_streamed_and_counts_the_echo(gateway: Any) -> None:
    _, client = await gateway()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "logprobs": 1, "ignore_eos": True}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert whole["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5]

    stream = await client.post("/v1/completions", json={**body, "stream": True})
    offsets = [
        o
        for e in _events(stream.text)
        if e["choices"][0]["logprobs"]
        for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == whole["logprobs"]["text_offset"]

    for stream_it in (False, True):
        echoed = await client.post(
            "/v1/completions", json={**body, "echo": True, "stream": stream_it}
        )
        if stream_it:
            chunks = [e["choices"][0] for e in _events(echoed.text)]
            text = "".join(c["text"] for c in chunks)
            fields = [c["logprobs"] for c in chunks if c["logprobs"]]
            assert chunks[0]["text"] == "abc" and fields[0]["tokens"] == ["a", "b", "c"]
            offsets = [o for f in fields for o in f["text_offset"]]
            tokens = [t for f in fields for t in f["tokens"]]
            values = [v for f in fields for v in f["token_logprobs"]]
            tops = [t for f in fields for t in f["top_logprobs"]]
        else:
            lp = echoed.json()["choices"][0]["logprobs"]
            text, offsets, tokens = (
                echoed.json()["choices"][0]["text"],
                lp["text_offset"],
                lp["tokens"],
            )
            values, tops = lp["token_logprobs"], lp["top_logprobs"]
        # The prompt's tokens come first: the first with none, the others as the engine
        # scored them (the fake: token i at -i/100); then the generated ones.
        assert text.startswith("abc") and offsets == list(range(9))
        assert [text[o : o + len(t)] for o, t in zip(offsets, tokens)] == tokens
        assert values[:3] == [None, -0.01, -0.02] and values[3:] == [-0.5] * 6
        assert tops[0] is None and tops[1] == {"b": -0.01} and tops[3] is not None


@pytest.mark.asyncio
async def test_echo_with_max_tokens_0_scores_the_prompt_alone(gateway: Any) -> None:
    """vLLM's scoring mode: the prompt echoed with its logprobs, nothing generated."""
    _, client = await gateway()
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = (await client.post("/v1/completions", json=body)).json()
    choice = whole["choices"][0]
    assert choice["text"] == "abc" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.01, -0.02]
    assert whole["usage"]["completion_tokens"] == 0 and whole["usage"]["prompt_tokens"] == 3

    stream = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [e["choices"][0] for e in _events(stream.text) if e["choices"]]
    assert "".join(c["text"] for c in chunks) == "abc"
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == ["a", "b", "c"] and chunks[-1]["finish_reason"] == "length"

    refused = await client.post("/v1/completions", json={**body, "echo": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def _byte_level_tokenizer(folder: Path) -> HFTokenizer:
    save_byte_level_tokenizer(folder)
    return HFTokenizer(folder)


def _byte_fallback_tokenizer(folder: Path) -> HFTokenizer:
    """SentencePiece style: words, and ``<0xC8>`` for a byte no word covers."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "<0xC8>": 2, "▁b": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))
    return HFTokenizer(folder)


def test_bytes_are_the_tokens_own_bytes(tmp_path: Path) -> None:
    acc = LogprobsAcc("chat")
    acc.add(ByteTokenizer(), [TokenLogprob(200, -0.1, ((200, -0.1), (201, -2.5), (65, -3.0)))])
    (entry,) = acc.render()["content"]
    assert entry["token"] == _REPLACEMENT and entry["bytes"] == [200]
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[200], [201], [65]]

    byte_level = _byte_level_tokenizer(tmp_path / "byte_level")
    assert byte_level.decode([200]) == _REPLACEMENT
    assert token_bytes(byte_level, 200) == b"\xc8"
    assert token_bytes(byte_level, 256) == b" hi"
    fallback = _byte_fallback_tokenizer(tmp_path / "byte_fallback")
    assert fallback.decode([2]) == _REPLACEMENT
    assert token_bytes(fallback, 2) == b"\xc8"
    assert token_bytes(fallback, 3) == b" b"


def test_top_logprobs_keeps_the_sampled_tokens_own_logprob() -> None:
    # 200, 201 and 202 are lone UTF-8 lead bytes: all three show as U+FFFD.
    top = ((200, -0.5), (201, -1.0), (202, -2.0), (65, -3.0))
    acc = LogprobsAcc("completion")
    acc.add(ByteTokenizer(), [TokenLogprob(201, -1.0, top), TokenLogprob(65, -3.0, top)])
    first, second = acc.render()["top_logprobs"]
    assert first == {_REPLACEMENT: -1.0, "A": -3.0}  # the sampled 201, not 200 or 202
    assert second == {_REPLACEMENT: -0.5, "A": -3.0}  # otherwise the most likely


@pytest.mark.asyncio
async def test_echoed_logprobs_per_choice_streamed_as_whole(gateway: Any) -> None:
    """Two prompts, two choices each: every choice echoes its own prompt with its
    logprobs first, streamed (each when its choice's first delta comes) as whole."""
    _, client = await gateway()
    body = {"model": MODEL, "prompt": ["abc", "de"], "n": 2, "max_tokens": 3}
    body |= {"echo": True, "logprobs": 0, "ignore_eos": True, "temperature": 0}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"]
    stream = await client.post("/v1/completions", json={**body, "stream": True})
    per_choice: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    for event in _events(stream.text):
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["logprobs"]:
                per_choice.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
    for c in whole:
        prompt = "abc" if c["index"] < 2 else "de"
        assert c["text"].startswith(prompt) and texts[c["index"]] == c["text"]
        assert c["logprobs"]["tokens"][: len(prompt)] == list(prompt)
        assert c["logprobs"]["token_logprobs"][0] is None
        assert per_choice[c["index"]] == c["logprobs"]["tokens"]
