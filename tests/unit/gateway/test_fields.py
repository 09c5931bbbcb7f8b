"""Nothing silently ignored: output-changing fields we lack are 400s, metadata is accepted,
other unknown fields are named in a warning; constraints and logit_bias reach the engine."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from services.engine.messages import StructuredOutput
from services.gateway.fields import logit_bias, structured_output
from services.gateway.protocol import ChatCompletionRequest
from tests.unit.gateway.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, None),  # empty asks for nothing: accepted
        ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"best_of": 3}, "best_of"),
        # vLLM's extensions that change the output: answered as if absent before.
        ({"allowed_token_ids": [3, 4]}, "allowed_token_ids"),
        ({"bad_words": ["w73"]}, "bad_words"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"length_penalty": 1.0}, None),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1.3}, None),  # implemented
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        ({"top_logprobs": 3}, "top_logprobs"),  # was answered without logprobs
        ({"top_logprobs": 0}, None),  # asks for nothing
        ({"top_logprobs": 3, "logprobs": True}, None),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"twelve": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "x" * 70_000}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
    ],
)
async def test_fields_we_cannot_honour_are_400s_naming_them(
    gateway: Any, patch: dict[str, Any], param: str | None
) -> None:
    _, client = await gateway()
    r = await client.post("/v1/chat/completions", json={**CHAT, **patch})
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.asyncio
@pytest.mark.parametrize(("suffix", "status"), [(None, 200), ("", 200), (" and so on", 400)])
async def test_a_completion_suffix_is_refused_not_ignored(
    gateway: Any, suffix: str | None, status: int
) -> None:
    """A suffix asks for text inserted before it (OpenAI's insert mode); it was accepted
    and dropped, so the completion did not lead into it."""
    _, client = await gateway()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "suffix": suffix}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "suffix"
        assert r.json()["error"]["message"] == "suffix is not supported by this server"


@pytest.mark.asyncio
async def test_metadata_is_accepted_and_unknown_fields_are_named_in_a_warning(
    gateway: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, client = await gateway()
    metadata = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    with caplog.at_level(logging.WARNING, logger="services.gateway.fields"):
        r = await client.post("/v1/chat/completions", json={**CHAT, **metadata})
        assert r.status_code == 200 and not caplog.records
        r = await client.post(
            "/v1/chat/completions", json={**CHAT, "frobnicate": 1, "modalities": ["text"]}
        )
    assert r.status_code == 200
    assert [rec.getMessage() for rec in caplog.records] == [
        "ignoring unknown request fields: frobnicate"
    ]


def _body(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **kw})


def test_constraints_become_backend_neutral_sampling_fields() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert structured_output(_body(response_format=rf)) == StructuredOutput(
        "json", json.dumps(SCHEMA), False, "response_format"
    )
    assert structured_output(_body(response_format={"type": "text"})) is None
    assert structured_output(_body()) is None
    assert structured_output(_body(response_format={"type": "json_object"})) == StructuredOutput(
        "json_object", "", False, "response_format"
    )
    so = structured_output(_body(structured_outputs={"choice": ["a", "b"]}))
    assert so == StructuredOutput("choice", '["a", "b"]', False, "structured_outputs")
    loose = {"json": SCHEMA, "disable_any_whitespace": False}
    assert structured_output(_body(structured_outputs=loose)) == StructuredOutput(
        "json", json.dumps(SCHEMA), True, "structured_outputs"
    )
    compact = {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}
    assert structured_output(_body(structured_outputs=compact)).any_whitespace is False  # type: ignore[union-attr]
    tag = {"structural_tag": {"type": "structural_tag"}}
    assert structured_output(_body(structured_outputs=tag)).kind == "structural_tag"  # type: ignore[union-attr]
    assert logit_bias(_body(logit_bias={"5": -100, "7": 2.5})) == ((5, -100.0), (7, 2.5))
