"""``tool_choice: auto`` end to end over HTTP: a scripted fake engine emits a fixed text
one character (one token, one stream chunk) at a time; the gateway's tool parser must give
the same tool calls and content streamed as not streamed."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from services.backends.fake import FakeEngine
from tests.unit.gateway.conftest import MODEL, GatewayFactory

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": 2}}</tool_call> ok'
)
LLAMA = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Bergen"}}; '
    '{"name": "get_time", "parameters": {}}'
)
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]


class ScriptedFakeEngine(FakeEngine):
    """A FakeEngine whose every request generates ``script``, then EOS (a fake: tests only)."""

    def __init__(self, script: str) -> None:
        super().__init__(max_model_len=2048)
        self._script = script

    def _next_token(self, seq: Any) -> int:
        # A token a millisecond, as a real engine paces them: unpaced, the whole script
        # is generated before the gateway reads, and arrives coalesced in one chunk.
        time.sleep(0.001)
        i = len(seq.output_ids)
        return ord(self._script[i]) if i < len(self._script) else 0


@dataclass(frozen=True)
class ScriptedFactory:
    script: str

    def __call__(self) -> ScriptedFakeEngine:
        return ScriptedFakeEngine(self.script)


def _body(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather and time?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 400,
        "stream": stream,
    }


@pytest.mark.parametrize(
    ("parser", "script", "content"),
    [("hermes", HERMES, "Let me check.  ok"), ("llama3_json", LLAMA, "")],
)
async def test_auto_tool_calls_streamed_char_by_char_equal_the_whole_answer(
    gateway: GatewayFactory, parser: str, script: str, content: str
) -> None:
    _, client = await gateway(
        engine_factory=ScriptedFactory(script),
        **{"workers.mode": "colocated", "gateway.tool_call_parser": parser},
    )
    whole = (await client.post("/v1/chat/completions", json=_body(False))).json()
    choice = whole["choices"][0]
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1])["city"] in ("Oslo", "Bergen")
    assert choice["finish_reason"] == "tool_calls"
    assert (choice["message"]["content"] or "") == content

    streamed: dict[int, list[str]] = {}
    text = ""
    finish = None
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=_body(True)) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            delta = json.loads(line[6:])["choices"][0]
            text += delta["delta"].get("content") or ""
            for frag in delta["delta"].get("tool_calls") or []:
                call = streamed.setdefault(frag["index"], ["", ""])
                call[0] += frag["function"].get("name", "")
                call[1] += frag["function"].get("arguments", "")
            finish = delta.get("finish_reason") or finish
    assert chunks >= 4  # role, content and calls arrived in separate chunks
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
    assert text == content and finish == "tool_calls"


async def test_a_vllm_registered_parser_by_name(gateway: GatewayFactory) -> None:
    """``--tool-call-parser pythonic``: not one of ours, so vLLM's parser of that name."""
    from services.cluster.serve import check_backend_options
    from services.config import ClusterConfig

    check_backend_options(ClusterConfig().with_overrides({"gateway.tool_call_parser": "pythonic"}))
    with pytest.raises(ValueError, match="no_such_parser"):
        check_backend_options(
            ClusterConfig().with_overrides({"gateway.tool_call_parser": "no_such_parser"})
        )
    script = '[get_weather(city="Oslo"), get_time(zone=2)]'
    _, client = await gateway(
        engine_factory=ScriptedFactory(script),
        **{"workers.mode": "colocated", "gateway.tool_call_parser": "pythonic"},
    )
    whole = (await client.post("/v1/chat/completions", json=_body(False))).json()["choices"][0]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": 2})]
    assert whole["finish_reason"] == "tool_calls"
    streamed: dict[int, list[str]] = {}
    async with client.stream("POST", "/v1/chat/completions", json=_body(True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for frag in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                    call = streamed.setdefault(frag["index"], ["", ""])
                    call[0] += frag["function"].get("name", "")
                    call[1] += frag["function"].get("arguments", "")
    assert [(n, json.loads(a)) for n, a in (streamed[i] for i in sorted(streamed))] == calls
