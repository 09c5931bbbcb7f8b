"""Tool calls: which mode a request is in, the grammar that forces calls, the calls parsed back.

    tool_mode(body)           None (no tools, or ``tool_choice: none``), ``auto``,
                              ``required`` or ``named`` (a forced function); ``allowed_tools``
                              narrows the tools first
    tool_constraint(mode)     the grammar for ``required`` / ``named``: it ends when the calls
                              end. ``named`` constrains the output to the function's
                              arguments; ``required`` to a JSON array of
                              ``{"name", "parameters"}`` objects (one if not parallel), as vLLM does
    forced_calls(mode, text)  the answer's ``tool_calls`` from that output
    ToolCallStream            the same calls as ``delta.tool_calls`` fragments: id and name
                              first, then arguments that concatenate to the non-streamed ones

``auto`` output is free text in the model's own tool-call syntax; with no tool-call parser
it is answered as content (the tools still reached the chat template).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from services.engine.messages import StructuredOutput
from services.gateway.errors import BadRequest
from services.gateway.protocol import ChatCompletionRequest, NamedToolChoice, Tool

__all__ = [
    "ToolCallStream",
    "ToolMode",
    "forced_calls",
    "new_call_id",
    "tool_constraint",
    "tool_mode",
]


@dataclass(frozen=True, slots=True)
class ToolMode:
    kind: Literal["auto", "required", "named"]
    tools: tuple[Tool, ...]
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.kind != "auto"

    @property
    def finish_reason(self) -> str:
        # OpenAI answers a forced named function with "stop", other calls with "tool_calls".
        return "stop" if self.kind == "named" else "tool_calls"


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    tools = tuple(body.tools)
    by_name = {t.function.name: t for t in tools}
    if len(by_name) != len(tools):
        raise BadRequest("tool names must be unique", "tools")
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", (_tool(by_name, choice.function.name),), False)
    kind: Literal["auto", "required"] = "auto"
    if choice is not None and not isinstance(choice, str):  # allowed_tools
        allowed = choice.allowed_tools
        tools = tuple(_tool(by_name, t.function.name) for t in allowed.tools)
        kind = allowed.mode
    elif choice == "required":
        kind = "required"
    return ToolMode(kind, tools, body.parallel_tool_calls)


def _tool(by_name: dict[str, Tool], name: str) -> Tool:
    if name not in by_name:
        raise BadRequest(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return by_name[name]


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(mode: ToolMode) -> StructuredOutput | None:
    if mode.kind == "named":
        return StructuredOutput("json", json.dumps(_parameters(mode.tools[0])), param="tools")
    if mode.kind == "auto":
        return None
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in mode.tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredOutput("json", json.dumps(schema), param="tools")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_calls(mode: ToolMode, text: str) -> list[dict[str, Any]]:
    """The tool calls in a forced output; none if a stop string cut it short."""
    if mode.kind == "named":
        pairs = [(mode.tools[0].function.name, text)]
    else:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return []
        pairs = [
            (c["name"], json.dumps(c["parameters"], separators=(",", ":"), ensure_ascii=False))
            for c in calls
        ]
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
        for name, args in pairs
    ]


@dataclass(slots=True)
class ToolCallStream:
    """``delta.tool_calls`` fragments for one choice of a forced-call stream."""

    mode: ToolMode
    _text: str = ""
    _started: bool = False
    _call_id: str = field(default_factory=new_call_id)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.mode.kind != "named":
            self._text += text  # a call's arguments are known once the array is parsed
            return []
        fragments: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            name = self.mode.tools[0].function.name
            fragments.append(
                {
                    "index": 0,
                    "id": self._call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        if text:
            fragments.append({"index": 0, "function": {"arguments": text}})
        return fragments

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last fragments and the choice's finish_reason."""
        if finish_reason != "stop":
            return [], finish_reason  # cut short (length): what was sent is all there is
        fragments: list[dict[str, Any]] = []
        if self.mode.kind != "named":
            calls = forced_calls(self.mode, self._text)
            if not calls:
                return [], finish_reason
            for i, call in enumerate(calls):
                fn = call["function"]
                fragments.append(
                    {
                        "index": i,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                )
                fragments.append({"index": i, "function": {"arguments": fn["arguments"]}})
        return fragments, self.mode.finish_reason
