"""The OpenAI wire format over an in-process gateway with FakeEngine workers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from router.policy import register_policy
from router.types import ClusterView, Reject, RequestProfile
from tests.unit.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}


@register_policy("test_always_reject")
@dataclass
class _AlwaysReject:
    name: str = "test_always_reject"

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Reject:
        return Reject("test says no", retry_after_s=2.5)


def _events(text: str) -> list[Any]:
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


async def test_disaggregated_text_equals_colocated(gateway: Any) -> None:
    _, colocated = await gateway(**{"workers.mode": "colocated"})
    _, disagg = await gateway(**{"workers.mode": "disaggregated"})
    for prompt in ["a", "hello world", "x" * 40]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0}
        a = (await colocated.post("/v1/completions", json=body)).json()
        b = (await disagg.post("/v1/completions", json=body)).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"] == b["usage"]
        assert a["usage"]["prompt_tokens"] == len(prompt)


async def test_chat_stream_framing_and_usage(gateway: Any) -> None:
    _, client = await gateway()
    body = {**CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    stream = await client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = _events(stream.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert (
        events[-1]["usage"]
        == whole["usage"]
        == {
            "prompt_tokens": whole["usage"]["prompt_tokens"],
            "completion_tokens": 12,
            "total_tokens": whole["usage"]["prompt_tokens"] + 12,
            "prompt_tokens_details": {"cached_tokens": 0},  # the fake caches nothing
        }
    )
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == whole["choices"][0]["message"]["content"]
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}


async def test_continuous_usage_counts_up(gateway: Any) -> None:
    _, client = await gateway()
    body = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    events = _events((await client.post("/v1/completions", json=body)).text)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(e["object"] == "text_completion" for e in events)


async def test_n_choices_and_multiple_prompts(gateway: Any) -> None:
    _, client = await gateway()
    body = {"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "temperature": 0}
    out = (await client.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    texts = [c["text"] for c in out["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: same per prompt
    assert texts[0] != texts[2]
    assert out["usage"]["prompt_tokens"] == 4  # each prompt once
    stream = await client.post("/v1/completions", json={**body, "stream": True})
    by_index: dict[int, str] = {}
    for e in _events(stream.text):
        for c in e["choices"]:
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
    assert [by_index[i] for i in range(4)] == texts


async def test_stop_string_cuts_text(gateway: Any) -> None:
    _, client = await gateway()
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 30, "temperature": 0}
    full = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    stop = full[5:7]
    cut = (await client.post("/v1/completions", json={**body, "stop": [stop]})).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_shapes(gateway: Any) -> None:
    _, client = await gateway()
    chat = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "ignore_eos": True},
    )
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == chat.json()["choices"][0]["message"]["content"]
    comp = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "abc", "max_tokens": 4, "logprobs": 1, "ignore_eos": True},
    )
    lp = comp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages"),
    ],
)
async def test_bad_params_are_400_naming_the_field(
    gateway: Any, patch: dict[str, Any], param: str
) -> None:
    _, client = await gateway()
    r = await client.post("/v1/chat/completions", json={**CHAT, **patch})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["message"]


async def test_unknown_fields_ignored_and_bad_json_is_400(gateway: Any) -> None:
    _, client = await gateway()
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    bad = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "error" in bad.json()


async def test_unknown_model_is_404(gateway: Any) -> None:
    _, client = await gateway()
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


async def test_api_key(gateway: Any) -> None:
    _, client = await gateway(**{"gateway.api_key": "sekret"})
    assert (await client.get("/v1/models")).status_code == 401
    wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    assert ok.json()["data"][0]["id"] == MODEL
    assert (await client.get("/health")).status_code == 200  # probes need no key
    # Non-ASCII bytes in the header: a 401 like any wrong key (it was a 500).
    odd = await client.get(
        "/v1/models", headers=[(b"authorization", "Bearer s\xe9kr\xebt".encode("latin-1"))]
    )
    assert odd.status_code == 401 and odd.json()["error"]["code"] == "invalid_api_key"


async def test_oversized_body_is_413(gateway: Any) -> None:
    _, client = await gateway(**{"gateway.max_body_bytes": 2048})
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    r = await client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "error" in r.json()


async def test_router_reject_is_429_with_retry_after(gateway: Any) -> None:
    svc, client = await gateway(**{"router.policy": "test_always_reject"})
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "RateLimitError"
    stream = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert stream.status_code == 429  # rejected before the stream starts
    assert svc.metrics.rejections.labels("test says no", "interactive")._value.get() == 2


async def test_not_ready_is_503(gateway: Any) -> None:
    svc, client = await gateway()
    for worker_id in list(svc.router.reports()):
        svc.router.mark_dead(worker_id)
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and "retry-after" in r.headers


async def test_models_metrics_openapi(gateway: Any) -> None:
    _, client = await gateway()
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 512
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    metrics = (await client.get("/metrics")).text
    assert 'baton_time_to_first_token_seconds_count{model="fake-model"} 1.0' in metrics
    assert 'baton_requests_total{model="fake-model",outcome="success"} 1.0' in metrics
    assert "baton_worker_kv_blocks" in metrics
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ChatMessage"} <= set(schemas)
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_aware", "slo_goodput"])
async def test_every_policy_places_requests_on_a_2p2d_cluster(gateway: Any, policy: str) -> None:
    svc, client = await gateway(
        **{
            "router.policy": policy,
            "router.max_hold_s": 2.0,
            "workers.prefill": 2,
            "workers.decode": 2,
        }
    )
    assert svc.policy_name == policy
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    texts = set()
    for _ in range(6):
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1  # same text whichever workers served it


async def test_prompts_times_n_is_capped_before_any_work(gateway: Any) -> None:
    _, client = await gateway(**{"gateway.max_sequences_per_request": 64})
    body = {"model": MODEL, "prompt": ["hi"] * 9, "n": 8, "max_tokens": 2}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "72 sequences" in r.json()["error"]["message"]
    ok = await client.post("/v1/completions", json={**body, "prompt": ["hi"] * 8})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 65}
    assert (await client.post("/v1/chat/completions", json=chat)).json()["error"]["param"] == "n"
