"""Every input bounded at the door: a 400 naming the field, before any work; a request
that outlives gateway.request_timeout_s ends (504, or an error event) and is aborted."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from services.backends.fake import FakeEngine
from tests.unit.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
VOCAB = 256  # FakeTokenizer's

PROBES = [
    ({"stop": ["x"] * 17}, "stop", "gateway.max_stop_strings"),
    ({"stop": "y" * 1025}, "stop", "gateway.max_stop_string_chars"),
    ({"top_k": 2**63}, "top_k", "vocabulary"),
    ({"top_k": VOCAB + 1}, "top_k", "vocabulary"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {str(2**63): 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"stop_token_ids": [3, VOCAB]}, "stop_token_ids", "token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
    ({"logit_bias": {"5": 1e30}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    # vLLM's sampler failed its whole step (every request in it) on a seed past 64 bits.
    ({"seed": 2**64}, "seed", "9223372036854775807"),
    ({"seed": -(2**63) - 1}, "seed", "-9223372036854775808"),
]


@pytest.mark.parametrize(("extra", "param", "says"), PROBES)
async def test_each_bound_is_a_400_naming_its_field(
    gateway: Any, extra: dict[str, Any], param: str, says: str
) -> None:
    _, client = await gateway()
    for path, body in (
        ("/v1/completions", BODY),
        ("/v1/chat/completions", {**BODY, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = await client.post(path, json={**body, **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("prompt", [[5, VOCAB], [-1], [[5, 6], [7, 2**63]]])
async def test_a_prompt_of_token_ids_past_the_vocabulary_is_a_400(
    gateway: Any, prompt: list[Any]
) -> None:
    _, client = await gateway()
    r = await client.post("/v1/completions", json={**BODY, "prompt": prompt})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "token ids" in error["message"], error
    served = await client.post("/v1/completions", json={**BODY, "prompt": [0, VOCAB - 1]})
    assert served.status_code == 200, served.text


async def test_values_at_the_bounds_are_served(gateway: Any) -> None:
    _, client = await gateway()
    ok = {
        "stop": ["z" * 1024] * 16,
        "top_k": VOCAB,
        "logit_bias": {"0": 100, str(VOCAB - 1): -100},
        "stop_token_ids": [0, VOCAB - 1],
    }
    r = await client.post("/v1/completions", json={**BODY, **ok})
    assert r.status_code == 200, r.text
    off = await client.post("/v1/completions", json={**BODY, "top_k": -1})
    assert off.status_code == 200, off.text
    for seed in (2**63 - 1, -(2**63)):  # n = 2: the second choice's seed wraps
        seeded = await client.post("/v1/completions", json={**BODY, "seed": seed, "n": 2})
        assert seeded.status_code == 200, seeded.text


async def test_the_stop_bounds_are_config(gateway: Any) -> None:
    _, client = await gateway(**{"gateway.max_stop_strings": 2, "gateway.max_stop_string_chars": 3})
    many = await client.post("/v1/completions", json={**BODY, "stop": ["a", "b", "c"]})
    assert many.status_code == 400 and "3 stop strings" in many.json()["error"]["message"]
    long = await client.post("/v1/completions", json={**BODY, "stop": "abcd"})
    assert long.status_code == 400 and long.json()["error"]["param"] == "stop"


class SlowFakeEngine(FakeEngine):
    """A fake whose every step takes 50 ms (tests only)."""

    def step(self) -> Any:
        time.sleep(0.05)
        return super().step()


async def test_request_timeout_is_a_504_or_an_error_event_and_frees_the_worker(
    gateway: Any,
) -> None:
    svc, client = await gateway(
        engine_factory=SlowFakeEngine,
        **{"gateway.request_timeout_s": 0.5, "workers.mode": "colocated"},
    )
    slow = {**BODY, "max_tokens": 200, "ignore_eos": True}
    started = time.monotonic()
    r = await client.post("/v1/completions", json=slow)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    stream = await client.post("/v1/completions", json={**slow, "stream": True})
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 3.0  # two requests of 10 s each, cut at 0.5 s
    frames = [f for f in stream.text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][len("data: ") :])
    assert last["error"]["code"] == "timeout"
    assert len(frames) > 3  # it streamed tokens before the deadline
    for _ in range(100):  # the aborted requests' blocks are freed
        snapshots = svc.router.reports().values()
        if all(s.num_used_blocks == 0 and not s.running for s in snapshots):
            break
        await asyncio.sleep(0.02)
    assert all(s.num_used_blocks == 0 and not s.running for s in svc.router.reports().values())


async def test_ready_lists_every_worker(gateway: Any) -> None:
    _, client = await gateway(**{"workers.prefill": 1, "workers.decode": 1})
    r = await client.get("/ready")
    assert r.status_code == 200
    body = r.json()
    assert body["ready"] is True
    assert sorted((w["role"], w["state"]) for w in body["workers"]) == [
        ("decode", "ready"),
        ("prefill", "ready"),
    ]
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "the request body is not valid JSON: Expecting property name"),
        (b'{"model": 1,', "(at character 12)"),
        (b"", "the request body is empty"),
        (b"[1]", "the request body must be a JSON object"),
        (b'"hello"', "the request body must be a JSON object"),
    ],
)
async def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(
    gateway: Any, body: bytes, says: str
) -> None:
    _, client = await gateway()
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        # No field to name: a character offset is not a parameter.
        assert says in error["message"] and error["param"] is None, error
    # The server keeps serving.
    ok = await client.post("/v1/completions", json=BODY)
    assert ok.status_code == 200, ok.text


async def test_json_sent_as_another_content_type_is_told_which_to_send(gateway: Any) -> None:
    _, client = await gateway()
    body = json.dumps(BODY).encode()
    r = await client.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "Content-Type: application/json" in message and "text/plain" in message


async def test_an_unknown_route_or_method_says_what_is_served(gateway: Any) -> None:
    _, client = await gateway()
    missing = await client.post("/v1/embeddings", json={"input": "x"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "NotFoundError"
    assert error["message"] == (
        "no route /v1/embeddings; Baton serves GET /v1/models, GET /v1/models/{model},"
        " POST /v1/chat/completions, POST /v1/completions, GET /openapi.json, GET /docs, GET /redoc, GET /health, GET /ready and"
        " GET /metrics"
    )
    wrong = await client.get("/v1/completions")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["message"].startswith(
        "GET is not allowed on /v1/completions, only POST; Baton serves GET /v1/models"
    )
    # A 404 with its own words (a model that is not served) keeps them.
    body = {**BODY, "model": "nope"}
    unknown = await client.post("/v1/completions", json=body)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]


async def test_a_completion_budget_past_the_context_is_named_by_the_field_it_came_in(
    gateway: Any,
) -> None:
    _, client = await gateway()
    chat = {**BODY, "messages": [{"role": "user", "content": "hi"}]}
    del chat["max_tokens"]
    for field in ("max_completion_tokens", "max_tokens"):
        r = await client.post("/v1/chat/completions", json={**chat, field: 100_000})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and f"Reduce the prompt or {field}" in error["message"]


@pytest.mark.parametrize("role", ["user", "system", "tool", "assistant"])
async def test_a_message_without_content_is_a_400(gateway: Any, role: str) -> None:
    _, client = await gateway()
    messages = [{"role": role}, {"role": "user", "content": "hi"}]
    r = await client.post("/v1/chat/completions", json={**BODY, "messages": messages})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages.0" and "needs its 'content' field" in error["message"]
    # An assistant's tool calls stand in for its content.
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    turn = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ]
    r = await client.post("/v1/chat/completions", json={**BODY, "messages": turn})
    assert r.status_code == 200, r.text
