"""The OpenAI request bodies we accept (pydantic: the HTTP edge only).

Unknown top-level fields are kept aside (``model_extra``) so that
``services.gateway.fields`` can refuse the ones that would change the output and
name the rest in a warning; nested objects ignore unknown fields. Range checks
live here so FastAPI reports them; our handler turns them into 400s naming the field.

Two fields are ours, not OpenAI's: ``slo`` (per-request latency targets, each
falling back to ``router.default_slo``) and ``priority`` (``batch`` requests are
shed first under load).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "JsonSchemaFormat",
    "LatencyTargets",
    "ResponseFormat",
    "StreamOptions",
    "StructuredOutputsRequest",
    "Tool",
    "ToolCall",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ImageURL(_Body):
    url: str


class ContentPart(_Body):
    type: Literal["text", "image_url", "input_text"]
    text: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _has_its_field(self) -> ContentPart:
        """A part carries what its type names: a text part without ``text`` was read
        as empty text, which the client did not send."""
        needs = "image_url" if self.type == "image_url" else "text"
        if getattr(self, needs) is None:
            raise ValueError(f"a content part of type {self.type!r} needs its {needs!r} field")
        return self


class FunctionCall(_Body):
    name: str = Field(max_length=256)
    arguments: str = Field(max_length=256 * 1024)  # a JSON string, as OpenAI sends it


class ToolCall(_Body):
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """Every message carries content, but an assistant's that makes tool calls
        (as OpenAI requires): a user message without it was read as empty text."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role!r} message needs its 'content' field"
                + (" (or 'tool_calls')" if self.role == "assistant" else "")
            )
        return self


class FunctionDef(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(_Body):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1, max_length=128)


class AllowedToolsChoice(_Body):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class LatencyTargets(_Body):
    """Targets for this request; one left out takes the server's ``router.default_slo``."""

    ttft_ms: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="time to first token, milliseconds"
    )
    tpot_ms: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="time per output token, milliseconds"
    )


# A hard ceiling for parsing; gateway.max_stop_strings is the bound users see.
Stop = str | Annotated[list[str], Field(max_length=256)] | None


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Body):
    """vLLM's ``structured_outputs`` extension: exactly one constraint kind."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None  # unset: compact JSON (Baton's default)


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")  # see services.gateway.fields

    model: str
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer, as vLLM
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)  # vLLM's; 1 is off
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    # Metadata: accepted, changes nothing about the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    slo: LatencyTargets | None = Field(None, description="Baton: latency targets")
    priority: Literal["interactive", "batch"] = Field(
        "interactive", description="Baton: batch requests are shed first under load"
    )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt scored alone
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True

    def chat_messages(self, keep_images: bool = False) -> list[dict[str, Any]]:
        """Messages as plain dicts for a chat template (text parts joined; with
        ``keep_images``, parts as the multimodal templates take them: ``{"type": "image"}``)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            content: Any = m.content
            if isinstance(content, list) and keep_images:
                content = [
                    {"type": "image"}
                    if p.type == "image_url"
                    else {"type": "text", "text": p.text or ""}
                    for p in content
                ]
            elif isinstance(content, list):
                content = "".join(p.text or "" for p in content if p.type != "image_url")
            message: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.tool_calls:
                # Templates receive arguments as dicts, as vLLM passes them.
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            out.append(message)
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (none when ``tool_choice`` is ``none``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def has_images(self) -> bool:
        return bool(self.image_urls())

    def image_urls(self) -> list[tuple[str, str]]:
        """``(param, url)`` of every image part, in order (param: ``messages[i].content[j]``)."""
        return [
            (f"messages[{i}].content[{j}]", p.image_url.url if p.image_url else "")
            for i, m in enumerate(self.messages)
            if isinstance(m.content, list)
            for j, p in enumerate(m.content)
            if p.type == "image_url"
        ]


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments  # a template may still show it; we do not guess
