"""A body pydantic refuses gets one 400 naming the field at fault, also where the field
takes one of several shapes (``content``, ``tool_choice``, ``stop``, ``prompt``): never
the first shape's complaint under a path with pydantic's tags in it."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from services.gateway.invalid import validation_error
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.gateway.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _content(content: Any) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": content}]}


CASES = [
    # A part's text of the wrong type: not "content should be a string".
    (_content([{"type": "text", "text": 5}]), "messages.0.content.0.text", "a valid string"),
    (
        _content([{"type": "input_audio", "input_audio": {}}]),
        "messages.0.content.0.type",
        "'text', 'image_url' or 'input_text'",
    ),
    (_content([{"text": "hi"}]), "messages.0.content.0.type", "Field required"),
    (_content([{"type": "text"}]), "messages.0.content.0", "type 'text' needs its 'text' field"),
    (_content([{"type": "image_url"}]), "messages.0.content.0", "needs its 'image_url' field"),
    (
        _content([{"type": "image_url", "image_url": {}}]),
        "messages.0.content.0.image_url.url",
        "Field required",
    ),
    # No shape fits at all: say what it may be.
    (_content(5), "messages.0.content", "Input should be a valid string or a valid list"),
    ({**CHAT, "stop": 5}, "stop", "a valid string or a valid list"),
    ({**CHAT, "stop": ["a", 5]}, "stop.1", "a valid string"),
    # An object shape whose type names another shape is not the one meant.
    ({**CHAT, "tool_choice": {"type": "function"}}, "tool_choice.function", "Field required"),
    (
        {**CHAT, "tool_choice": {"type": "allowed_tools"}},
        "tool_choice.allowed_tools",
        "Field required",
    ),
    (
        {**CHAT, "tool_choice": {"type": "bogus"}},
        "tool_choice.type",
        "'function' or 'allowed_tools'",
    ),
    (
        {**CHAT, "tool_choice": "sometimes"},
        "tool_choice",
        "Input should be 'none', 'auto' or 'required' or an object",
    ),
    ({**CHAT, "structured_outputs": {"json": 5}}, "structured_outputs.json", "dictionary or a"),
    # A field of one shape keeps its plain path and message.
    ({**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "messages": [{"role": "wizard", "content": 5}]}, "messages.0.role", "'developer'"),
    ({**PROMPT, "prompt": 5.5}, "prompt", "a valid string or a valid list"),
    ({**PROMPT, "prompt": [[1], [2, "x"]]}, "prompt.1.1", "a valid integer"),
]


def _refusal(body: dict[str, Any]) -> tuple[str | None, str]:
    model: type[BaseModel] = CompletionRequest if "prompt" in body else ChatCompletionRequest
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    # As FastAPI hands them over: each location under "body".
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    refusal = validation_error(errors)
    return refusal.param, refusal.message


@pytest.mark.parametrize(("body", "param", "says"), CASES)
def test_the_400_names_the_field_at_fault(body: dict[str, Any], param: str, says: str) -> None:
    got_param, message = _refusal(body)
    assert got_param == param and says in message, (got_param, message)
    assert message.endswith(f"({param})")
    # pydantic's shape tags and class names never reach the client.
    assert not {"str", "int", "none"} & set(param.split(".")) and "[" not in param, param
    for internal in ("list[", "literal[", "ToolChoice", "ContentPart", "Value error"):
        assert internal not in message, message


@pytest.mark.asyncio
async def test_the_server_answers_a_bad_part_with_its_field_and_keeps_serving(
    gateway: Any,
) -> None:
    _, client = await gateway()
    for content, param in (
        ([{"type": "text", "text": 5}], "messages.0.content.0.text"),
        ([{"type": "text"}], "messages.0.content.0"),  # served as empty text before
    ):
        r = await client.post("/v1/chat/completions", json=_content(content))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    ok = await client.post("/v1/chat/completions", json=_content([{"type": "text", "text": "hi"}]))
    assert ok.status_code == 200, ok.text
