"""Reasoning and tool-call parsers: any split of the text gives the whole text's answer."""

from __future__ import annotations

import json

import pytest

from services.gateway.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    OutputParser,
    Parsed,
    split_output,
)
from services.gateway.protocol import Tool
from services.gateway.shaping import ChoiceShaper, ShapeSpec
from services.gateway.tools import ToolMode

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call> ok <tool'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "parameters": {}}'
CASES = [
    (
        None,
        "hermes",
        HERMES,
        Parsed(
            "",
            "Let me check.  ok <tool",
            [("get_weather", '{"city":"Oslo"}'), ("get_time", '{"zone":2}')],
        ),
    ),
    (
        None,
        "hermes",
        "<tool_call>{not json}</tool_call>",
        Parsed("", "<tool_call>{not json}</tool_call>", []),
    ),
    (None, "hermes", '<tool_call>{"name": "f", "arguments": {}}', Parsed("", "", [("f", "{}")])),
    (
        None,
        "llama3_json",
        LLAMA,
        Parsed("", "", [("get_weather", '{"city":"Zürich"}'), ("get_time", "{}")]),
    ),
    (None, "llama3_json", "Just text {x}", Parsed("", "Just text {x}", [])),
    (None, "llama3_json", '{"name": "f"', Parsed("", '{"name": "f"', [])),
    ("deepseek_r1", None, "hmm, think</think>The answer", Parsed("hmm, think", "The answer", [])),
    ("deepseek_r1", None, "<think>a<b</think>c", Parsed("a<b", "c", [])),
    ("deepseek_r1", None, "never closed <th", Parsed("never closed <th", "", [])),
    ("qwen3", None, "no thinking </think>", Parsed("", "no thinking </think>", [])),
    (
        "qwen3",
        "hermes",
        '<think>call it</think>\n<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>',
        Parsed("call it", "\n", [("f", '{"a":[1]}')]),
    ),
]


def _parser(reasoning: str | None, tools: str | None) -> OutputParser:
    return OutputParser(
        REASONING_PARSERS[reasoning]() if reasoning else None,
        TOOL_PARSERS[tools]() if tools else None,
    )


@pytest.mark.parametrize(("reasoning", "tools", "text", "expected"), CASES)
def test_every_split_gives_the_whole_texts_answer(
    reasoning: str | None, tools: str | None, text: str, expected: Parsed
) -> None:
    assert split_output(_parser(reasoning, tools), text) == expected
    raw = text.encode()
    for cut in range(1, len(raw)):
        # Bytes split like a stream might; a text delta is never half a character.
        head = raw[:cut].decode(errors="ignore")
        pieces = [head, text[len(head) :]]
        parser = _parser(reasoning, tools)
        got = Parsed()
        for piece in pieces:
            got.extend(parser.feed(piece))
        got.extend(parser.finish())
        assert got == expected, cut
    one_char = _parser(reasoning, tools)
    got = Parsed()
    for ch in text:
        got.extend(one_char.feed(ch))
    got.extend(one_char.finish())
    assert got == expected


def test_arguments_are_json_strings() -> None:
    out = split_output(_parser(None, "hermes"), HERMES)
    assert [json.loads(args) for _, args in out.calls] == [{"city": "Oslo"}, {"zone": 2}]


def _auto_mode() -> ToolMode:
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
    return ToolMode("auto", (tool,))


def _streamed(
    spec: ShapeSpec, pieces: list[str]
) -> tuple[str, str, list[tuple[str, str]], str | None]:
    shaper = ChoiceShaper(spec)
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for k, piece in enumerate(pieces):
        d = shaper.delta(piece, "stop" if k == len(pieces) - 1 else None)
        content += d.content
        reasoning += d.reasoning
        for frag in d.tool_calls:
            call = calls.setdefault(frag["index"], ["", ""])
            call[0] += frag["function"].get("name", "")
            call[1] += frag["function"]["arguments"]
            assert ("id" in frag) == ("name" in frag["function"])  # id and name come first
        finish = d.finish_reason
    return content, reasoning, [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize(
    ("parser", "reasoning", "text"),
    [
        ("hermes", None, HERMES),
        ("llama3_json", None, LLAMA),
        ("hermes", "deepseek_r1", "think first</think>" + HERMES),
        ("hermes", None, "plain text, no calls"),
    ],
)
def test_auto_mode_streams_the_same_calls_and_content_as_the_whole_answer(
    parser: str, reasoning: str | None, text: str
) -> None:
    spec = ShapeSpec(_auto_mode(), reasoning, parser)
    message, finish = ChoiceShaper(spec).whole(text, "stop")
    whole_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert finish == ("tool_calls" if whole_calls else "stop")
    raw = text.encode()
    for cut in range(1, len(raw)):
        head = raw[:cut].decode(errors="ignore")
        got = _streamed(spec, [head, text[len(head) :]])
        assert got == (message["content"] or "", message.get("reasoning", ""), whole_calls, finish)
    hidden = ShapeSpec(_auto_mode(), reasoning, parser, include_reasoning=False)
    assert "reasoning" not in ChoiceShaper(hidden).whole(text, "stop")[0]


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_named_call_is_a_call_streamed_or_whole_however_it_ended(finish: str) -> None:
    """Cut short by max_tokens, a forced named function's arguments are still its
    call's (as far as they got), streamed and whole alike (the whole answer gave them
    as content, with no call)."""
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
    spec = ShapeSpec(ToolMode("named", (tool,), False))
    text = '{"city": "Os' if finish == "length" else '{"city": "Oslo"}'
    message, whole_finish = ChoiceShaper(spec).whole(text, finish)
    assert message["content"] is None and whole_finish == finish
    (call,) = message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", text)
    shaper = ChoiceShaper(spec)
    first, last = shaper.delta(text[:5], None), shaper.delta(text[5:], finish)
    streamed = "".join(f["function"]["arguments"] for f in first.tool_calls + last.tool_calls)
    assert streamed == text and last.finish_reason == whole_finish
