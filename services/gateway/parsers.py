"""Reasoning and tool-call parsers: model text in, (reasoning, content, tool calls) out.

Each parser is a small state machine fed the text of one choice in pieces, in order
(a stream's deltas, or the whole text at once) and then finished. It returns what is
known for sure so far and holds back only text that may still be the start of a marker,
so any split of the text gives the same result as the whole.

    REASONING_PARSERS   deepseek_r1 (thinking until ``</think>``, the opening tag
                        optional: templates often put it in the prompt), qwen3
                        (thinking only when the text opens with ``<think>``)
    TOOL_PARSERS        hermes (``<tool_call>{"name", "arguments"}</tool_call>``, Qwen 2.5/3),
                        llama3_json (a JSON object ``{"name", "parameters"}``, calls
                        separated by ``;``, optionally after ``<|python_tag|>``)

A call is ``(name, arguments JSON string)``. Text that looks like a call but does not
parse is content: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "Parsed",
    "ReasoningParser",
    "ToolParser",
    "check_tool_call_parser",
    "make_tool_parser",
    "split_output",
]

Call = tuple[str, str]


@dataclass(slots=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


class ReasoningParser(Protocol):
    def feed(self, text: str) -> Parsed: ...  # reasoning and content only

    def finish(self) -> Parsed: ...


class ToolParser(Protocol):
    def feed(self, text: str) -> Parsed: ...  # content and calls only

    def finish(self) -> Parsed: ...


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _ThinkParser:
    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, *, needs_open_tag: bool) -> None:
        self._needs_open = needs_open_tag
        self._buf = ""
        self._state = "start"  # start -> thinking -> content

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(self.OPEN):
                    self._buf = stripped[len(self.OPEN) :]
                    self._state = "thinking"
                elif self.OPEN.startswith(stripped):
                    return out  # may still become the open tag
                else:
                    self._state = "content" if self._needs_open else "thinking"
            elif self._state == "thinking":
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    keep = _held_prefix(self._buf, self.CLOSE)
                    out.reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.reasoning += self._buf[:end]
                self._buf = self._buf[end + len(self.CLOSE) :]
                self._state = "content"
            else:
                out.content += self._buf
                self._buf = ""
                return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._state == "thinking":
            out.reasoning = self._buf
        else:
            out.content = self._buf
        self._buf = ""
        return out


def _call(name: Any, arguments: Any) -> Call | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if not self._in_call:
                start = self._buf.find(self.OPEN)
                if start < 0:
                    keep = _held_prefix(self._buf, self.OPEN)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:start]
                self._buf = self._buf[start + len(self.OPEN) :]
                self._in_call = True
            else:
                end = self._buf.find(self.CLOSE)
                if end < 0:
                    return out
                self._emit(self._buf[:end], out, self.OPEN + self._buf[: end + len(self.CLOSE)])
                self._buf = self._buf[end + len(self.CLOSE) :]
                self._in_call = False

    def _emit(self, body: str, out: Parsed, raw: str) -> None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        call = _call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
        if call is None:
            out.content += raw
        else:
            out.calls.append(call)

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:  # a call cut at EOS without its closing tag
            self._emit(self._buf, out, self.OPEN + self._buf)
        else:
            out.content = self._buf
        self._buf, self._in_call = "", False
        return out


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start -> calls (held to the end) | content

    def feed(self, text: str) -> Parsed:
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode = "calls"
            elif not head or self.TAG.startswith(head):
                return Parsed()
            else:
                self._mode = "content"
        if self._mode == "content":
            out, self._buf = Parsed(content=self._buf), ""
            return out
        return Parsed()

    def finish(self) -> Parsed:
        text, self._buf = self._buf, ""
        if self._mode != "calls":
            return Parsed(content=text)
        body = text.lstrip().removeprefix(self.TAG)
        calls: list[Call] = []
        for part in body.split(";"):
            try:
                obj = json.loads(part)
            except json.JSONDecodeError:
                return Parsed(content=text)
            call = (
                _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
                if isinstance(obj, dict)
                else None
            )
            if call is None:
                return Parsed(content=text)
            calls.append(call)
        return Parsed(calls=calls)


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    "deepseek_r1": lambda: _ThinkParser(needs_open_tag=False),
    "qwen3": lambda: _ThinkParser(needs_open_tag=True),
}
TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def make_tool_parser(
    name: str, tokenizer: Any = None, tools: Sequence[dict[str, Any]] = ()
) -> ToolParser:
    """One of ours by name, else vLLM's parser of that name (KeyError if neither has it)."""
    ours = TOOL_PARSERS.get(name)
    if ours is not None:
        return ours()
    from services.gateway.vllm_tool_parsers import VllmToolParser, vllm_tool_parser_names

    if name not in vllm_tool_parser_names():
        raise KeyError(f"unknown tool call parser {name!r}")
    return VllmToolParser(name, tokenizer, tools)


def check_tool_call_parser(name: str | None) -> None:
    """At start: ValueError naming ours and vLLM's parsers if ``name`` is neither."""
    if name is None or name in TOOL_PARSERS:
        return
    from services.gateway.vllm_tool_parsers import vllm_tool_parser_names

    known = vllm_tool_parser_names()
    if name not in known:
        raise ValueError(
            f"gateway.tool_call_parser {name!r} is unknown; Baton's: {sorted(TOOL_PARSERS)}"
            + (f"; vLLM's: {known}" if known else " (vLLM is not installed)")
        )


class OutputParser:
    """Reasoning first, then tool calls in what follows, for one choice."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> Parsed:
        return self._through_tools(
            self._reasoning.feed(text) if self._reasoning else Parsed(content=text)
        )

    def finish(self) -> Parsed:
        out = self._through_tools(self._reasoning.finish() if self._reasoning else Parsed())
        if self._tools is not None:
            out.extend(self._tools.finish())
        return out

    def _through_tools(self, parsed: Parsed) -> Parsed:
        if self._tools is None or not parsed.content:
            return parsed
        after = self._tools.feed(parsed.content)
        after.reasoning = parsed.reasoning
        return after


def split_output(parser: OutputParser, text: str) -> Parsed:
    """The whole text at once (the non-streaming answer)."""
    out = parser.feed(text)
    out.extend(parser.finish())
    return out
