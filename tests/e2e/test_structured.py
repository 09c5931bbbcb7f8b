"""Structured outputs through the official ``openai`` client on real servers (tiny engine).

The same 16 ``parse`` requests, greedy and seeded, give identical raw texts colocated,
1 prefill + 1 decode, and 1P+1D with the decode worker killed (Ray actor, SIGKILL)
mid-stream: the grammar's state continues from the committed tokens alone.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

MODEL = "tiny"
PROMPTS = [f"Pet number {i}: describe it as JSON. " + "meow " * (i % 5) for i in range(16)]
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}]


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=30)]
    kind: Literal["cat", "dog", "fish"]


PET_SCHEMA = Pet.model_json_schema()


@pytest.fixture(scope="module")
def colocated() -> Iterator[ServedGateway]:
    config = tiny_config(**{"workers.mode": "colocated", "workers.prefill": 1, "workers.decode": 0})
    with ServedGateway(real_service(config, ray=False)) as s:
        yield s


@pytest.fixture(scope="module")
def split() -> Iterator[ServedGateway]:
    config = tiny_config(**{"kvtransfer.backend": "local"})
    with ServedGateway(real_service(config, ray=False)) as s:
        yield s


def _client(server: ServedGateway) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def _parse_all(server: ServedGateway) -> list[str]:
    """Every (prompt, sampling) through ``chat.completions.parse``; the raw texts, in order."""
    client = _client(server)

    def one(job: tuple[str, dict[str, Any]]) -> str:
        prompt, sampling = job
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=Pet,
            max_tokens=200,
            **sampling,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        text = choice.message.content or ""
        jsonschema.validate(json.loads(text), PET_SCHEMA)
        return text

    jobs = [(p, s) for s in SAMPLINGS for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, jobs))


def test_parse_is_the_same_colocated_and_disaggregated(
    colocated: ServedGateway, split: ServedGateway
) -> None:
    expected = _parse_all(colocated)
    assert _parse_all(split) == expected
    assert len(set(expected)) > 4  # the prompts really give different objects
    assert split.svc.metrics.transfer_bytes.labels("local")._value.get() > 0


def test_choice_regex_and_logit_bias(split: ServedGateway) -> None:
    client = _client(split)
    choices = ["red", "green", "blue"]
    for seed in range(6):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"colour {seed}"}],
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].message.content in choices
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"code {seed}"}],
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}},
        )
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", r.choices[0].message.content or "")
    r = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=5, temperature=0, logit_bias={str(ord("Z")): 100}
    )
    assert r.choices[0].text == "ZZZZZ"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"enum": ["x" * 70_000]}}}, "structured_outputs"),
    ],
)
def test_bad_constraints_are_400_within_a_second_and_serving_goes_on(
    split: ServedGateway, patch: dict[str, Any], param: str
) -> None:
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **patch}
    start = time.monotonic()
    r = httpx.post(f"{split.base_url}/v1/chat/completions", json=body, timeout=10)
    assert time.monotonic() - start < 1.0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = _client(split).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def ray_1p1d(ray_cluster: str) -> Iterator[ServedGateway]:
    config = tiny_config(**{"kvtransfer.backend": "torch", "router.max_hold_s": 60.0})
    with ServedGateway(real_service(config, ray=True, replace_dead=True)) as s:
        yield s


@pytest.mark.ray
@pytest.mark.slow
def test_parse_survives_the_decode_worker_killed_mid_stream(
    colocated: ServedGateway, ray_1p1d: ServedGateway
) -> None:
    import ray

    expected = _parse_all(colocated)
    client = _client(ray_1p1d)
    chunks_seen = threading.Event()

    def one(job: tuple[str, dict[str, Any]]) -> str:
        prompt, sampling = job
        num_chunks = 0
        with client.chat.completions.stream(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format=Pet,
            max_tokens=200,
            **sampling,
        ) as stream:
            for event in stream:
                if event.type == "content.delta":
                    num_chunks += 1
                    if num_chunks == 4:
                        chunks_seen.set()
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Pet)
        return final.choices[0].message.content or ""

    jobs = [(p, s) for s in SAMPLINGS for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, job) for job in jobs]
        assert chunks_seen.wait(60)
        victim = ray_1p1d.svc.controller.client("decode-0")
        assert victim is not None
        ray.kill(victim.actor, no_restart=True)  # type: ignore[attr-defined]
        got = [f.result(timeout=180) for f in futures]
    assert got == expected
    assert ray_1p1d.svc.metrics.retries.labels("worker_died")._value.get() >= 1


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed_calls(client: OpenAI, **kw: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for frag in choice.delta.tool_calls or ():
            call = calls.setdefault(frag.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += frag.id or ""
            if frag.function is not None:
                call["name"] += frag.function.name or ""
                call["arguments"] += frag.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("tool_choice", "finish"),
    [
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_time"}}, "stop"),
    ],
)
def test_forced_tool_calls_streamed_and_not(
    split: ServedGateway, tool_choice: Any, finish: str
) -> None:
    client = _client(split)
    for seed in range(3):
        kw: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"What now? ({seed})"}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "temperature": 1.0,
            "seed": seed,
            "max_tokens": 300,
        }
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == finish
        assert whole.message.content is None and whole.message.tool_calls
        for call in whole.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in whole.message.tool_calls] == ["get_time"]
        streamed, stream_finish = _streamed_calls(client, **kw)
        assert stream_finish == finish
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        assert all(c["id"].startswith("call_") for c in streamed)


def test_a_tool_call_round_trip_reaches_the_template(split: ServedGateway) -> None:
    """The history's calls and the tool's answer are in the prompt the model saw."""
    client = _client(split)
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=300
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    calls = first.choices[0].message.tool_calls or []
    as_templated = [
        {"function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in calls
    ]
    assistant = {"role": "assistant", "content": "", "tool_calls": as_templated}
    rendered = split.svc.tokenizer.apply_chat_template(
        [messages[0], assistant, messages[2]], tools=TOOLS
    )
    expected = len(split.svc.tokenizer.encode(rendered, add_special_tokens=False))
    assert second.usage is not None and second.usage.prompt_tokens == expected
    assert call.function.name in rendered and "sunny, 21" in rendered and "<tools>" in rendered
