"""One chat choice's text shaped into the answer: content, reasoning, tool calls.

    forced tool calls   the text is the calls (tools.py): ``tool_calls``, content null
    parsers             a reasoning parser and, for ``tool_choice: auto``, a tool-call
                        parser (parsers.py) split the text; ``include_reasoning: false``
                        drops the reasoning
    otherwise           the text is the content

``whole`` answers a finished choice at once; ``delta`` does the same per stream delta, so
the streamed fields concatenate to the whole answer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.parsers import REASONING_PARSERS, OutputParser, Parsed, make_tool_parser
from services.gateway.tools import ToolCallStream, ToolMode, forced_calls, new_call_id

__all__ = ["ChoiceShaper", "ShapeSpec", "StreamDelta"]


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """How a generation's chat choices are shaped (None everywhere: text as content)."""

    tool_mode: ToolMode | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    include_reasoning: bool = True
    # The model's Hugging Face tokenizer, for vLLM's tool parsers (some read its vocabulary).
    hf_tokenizer: Any = field(default=None, compare=False)

    @property
    def is_plain(self) -> bool:
        return self.tool_mode is None and self.reasoning_parser is None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceShaper:
    def __init__(self, spec: ShapeSpec) -> None:
        self._spec = spec
        mode = spec.tool_mode
        self._forced = ToolCallStream(mode) if mode is not None and mode.forced else None
        tools = None
        if mode is not None and mode.kind == "auto" and spec.tool_call_parser is not None:
            offered = [t.model_dump(exclude_none=True) for t in mode.tools]
            tools = make_tool_parser(spec.tool_call_parser, spec.hf_tokenizer, offered)
        reasoning = REASONING_PARSERS[spec.reasoning_parser]() if spec.reasoning_parser else None
        self._parser = OutputParser(reasoning, tools) if (tools or reasoning) else None
        self._num_calls = 0

    def whole(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The message and finish_reason of a finished choice."""
        mode = self._spec.tool_mode
        if self._forced is not None and mode is not None:
            # A named function's output is its arguments, however it ended (cut short by
            # length: as far as they got, as streamed and as vLLM answers); a list of
            # calls is known only once it parses.
            named = mode.kind == "named"
            calls = forced_calls(mode, text) if finish == "stop" or named else []
            if calls:
                return _message(None, "", calls), mode.finish_reason if finish == "stop" else finish
            return _message(text, "", []), finish
        if self._parser is None:
            return _message(text, "", []), finish
        parsed = self._parser.feed(text)
        parsed.extend(self._parser.finish())
        calls = [_call(name, args) for name, args in parsed.calls]
        reasoning = parsed.reasoning if self._spec.include_reasoning else ""
        content = parsed.content if (parsed.content or not calls) else None
        return _message(content, reasoning, calls), _finish_with_calls(finish, bool(calls))

    def delta(self, text: str, finish: str | None) -> StreamDelta:
        if self._forced is not None:
            out = StreamDelta(tool_calls=self._forced.feed(text))
            if finish is not None:
                last, finish = self._forced.finish(finish)
                out.tool_calls += last
            out.finish_reason = finish
            return out
        if self._parser is None:
            return StreamDelta(content=text, finish_reason=finish)
        parsed = self._parser.feed(text)
        if finish is not None:
            parsed.extend(self._parser.finish())
        out = self._stream_parsed(parsed)
        out.finish_reason = _finish_with_calls(finish, self._num_calls > 0)
        return out

    def _stream_parsed(self, parsed: Parsed) -> StreamDelta:
        out = StreamDelta(content=parsed.content)
        if self._spec.include_reasoning:
            out.reasoning = parsed.reasoning
        for name, args in parsed.calls:
            call = _call(name, args)
            index = self._num_calls
            self._num_calls += 1
            out.tool_calls.append(
                {**call, "index": index, "function": {"name": name, "arguments": ""}}
            )
            out.tool_calls.append({"index": index, "function": {"arguments": args}})
        return out


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _message(content: str | None, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _finish_with_calls(finish: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and finish == "stop" else finish
