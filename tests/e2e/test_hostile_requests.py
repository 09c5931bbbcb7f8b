"""Hostile requests against a live keyed cluster (real tiny engine, 2 prefill + 2 decode,
slo_goodput, an API key, a real uvicorn server): each probe gets its 4xx within a second,
and afterwards greedy requests return exactly the text they returned before; a hypothesis
fuzz over the request schemas finds no 5xx, no hang and no dead worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = [f"Relay race number {i} begins" for i in range(8)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServedGateway]:
    config = tiny_config(
        **{
            "kvtransfer.backend": "local",
            "workers.prefill": 2,
            "workers.decode": 2,
            "router.policy": "slo_goodput",
            "router.max_hold_s": 2.0,
            "gateway.api_key": KEY,
            "gateway.max_header_bytes": 8192,
        }
    )
    with ServedGateway(real_service(config, ray=False, replace_dead=True)) as s:
        yield s


def _greedy_texts(base_url: str) -> list[str]:
    def one(prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, GREEDY))


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}


# (name, path, body: a dict sent as JSON or raw bytes, extra headers, expected status, param)
PROBES: list[tuple[str, str, Any, dict[str, Any], int, str | None]] = [
    ("top_k 2^63", "completions", _completion(top_k=2**63, temperature=1), {}, 400, "top_k"),
    ("top_k past vocab", "chat", _chat(top_k=10**6, temperature=1), {}, 400, "top_k"),
    (
        "logit_bias key",
        "completions",
        _completion(logit_bias={"99999999": 1}),
        {},
        400,
        "logit_bias",
    ),
    ("logit_bias 2^63", "chat", _chat(logit_bias={str(2**63): 1}), {}, 400, "logit_bias"),
    ("logit_bias 1e30", "completions", _completion(logit_bias={"5": 1e30}), {}, 400, "logit_bias"),
    ("prompts x n", "completions", _completion(prompt=["p"] * 1000, n=16), {}, 400, "n"),
    ("n past 16", "chat", _chat(n=17), {}, 400, "n"),
    ("stop count", "completions", _completion(stop=["s"] * 17), {}, 400, "stop"),
    ("stop length", "chat", _chat(stop="s" * 200_000), {}, 400, "stop"),
    ("token id", "completions", _completion(prompt=[10**9]), {}, 400, "prompt"),
    ("negative token id", "completions", _completion(prompt=[-1]), {}, 400, None),
    ("max_tokens", "completions", _completion(max_tokens=10**12), {}, 400, "max_tokens"),
    ("logprobs", "completions", _completion(logprobs=21), {}, 400, "logprobs"),
    ("NaN", "completions", b'{"model":"tiny","prompt":"hi","temperature":NaN}', {}, 400, None),
    ("Infinity", "chat", b'{"model":"tiny","messages":[],"top_p":Infinity}', {}, 400, None),
    ("deep JSON", "completions", b"[" * 100_000 + b"]" * 100_000, {}, 400, None),
    ("2 MB prompt", "completions", _completion(prompt="a" * 2_000_000), {}, 400, "prompt"),
    ("body over the cap", "completions", b"x" * (5 * 2**20), {}, 413, None),
    (
        "non-ASCII key",
        "completions",
        _completion(),
        {"Authorization": b"Bearer \xff\xfe"},
        401,
        None,
    ),
    ("wrong key", "completions", _completion(), {"Authorization": "Bearer nope"}, 401, None),
    ("no key", "completions", _completion(), {"Authorization": ""}, 401, None),
    ("headers over the cap", "completions", _completion(), {"X-Pad": "p" * 16384}, 431, None),
    ("unknown model", "chat", {**_chat(), "model": "gpt-9"}, {}, 404, "model"),
    ("unimplemented field", "chat", _chat(audio={"voice": "x"}), {}, 400, "audio"),
    ("temperature", "chat", _chat(temperature=9), {}, 400, "temperature"),
]


@pytest.mark.slow
def test_each_probe_is_a_fast_4xx_and_greedy_text_is_unchanged(server: ServedGateway) -> None:
    before = _greedy_texts(server.base_url)
    workers_before = set(server.svc.controller.workers())
    with httpx.Client(base_url=f"{server.base_url}/v1", timeout=10) as client:
        for name, path, body, headers, status, param in PROBES:
            hdrs = {**AUTH, **headers}
            if not hdrs.get("Authorization"):
                hdrs.pop("Authorization")
            url = f"/{'chat/completions' if path == 'chat' else 'completions'}"
            started = time.monotonic()
            if isinstance(body, bytes):
                r = client.post(
                    url, content=body, headers={**hdrs, "Content-Type": "application/json"}
                )
            else:
                r = client.post(url, json=body, headers=hdrs)
            elapsed_s = time.monotonic() - started
            assert r.status_code == status, (name, r.status_code, r.text[:300])
            assert elapsed_s < 1.0, (name, elapsed_s)
            if status != 431:
                error = r.json()["error"]  # OpenAI's shape
                assert {"message", "type", "param", "code"} <= set(error), name
                if param is not None:
                    assert error["param"] == param, (name, error)
    assert _greedy_texts(server.base_url) == before
    assert set(server.svc.controller.workers()) == workers_before  # no worker died
    ready = httpx.get(f"{server.base_url}/ready", timeout=5).json()
    assert all(w["state"] == "ready" for w in ready["workers"])


# -- fuzz ------------------------------------------------------------------------------
_ints = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70))
_floats = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))
_text = st.text(max_size=40)
_anything = st.one_of(st.none(), st.booleans(), _ints, _floats, _text, st.lists(_ints, max_size=3))
_sampling = {
    "n": st.one_of(st.integers(1, 3), _ints),
    "max_tokens": st.one_of(st.integers(1, 8), _ints),
    "temperature": _floats,
    "top_p": _floats,
    "top_k": _ints,
    "min_p": _floats,
    "seed": _ints,
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "stop": st.one_of(_text, st.lists(_text, max_size=20)),
    "stop_token_ids": st.lists(_ints, max_size=4),
    "logit_bias": st.dictionaries(st.one_of(_text, _ints.map(str)), _floats, max_size=4),
    "min_tokens": _ints,
    "ignore_eos": _anything,
    "stream": st.booleans(),
    "logprobs": _anything,
    "top_logprobs": _ints,
    "response_format": st.one_of(
        st.none(),
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}
        ),
    ),
    "slo": st.one_of(st.none(), st.fixed_dictionaries({"ttft_ms": _floats, "tpot_ms": _floats})),
    "priority": st.one_of(st.sampled_from(["interactive", "batch"]), _text),
    "echo": _anything,
}
_prompt = st.one_of(_text, st.lists(_text, max_size=3), st.lists(_ints, max_size=4))
_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": _anything,
        }
    ),
    max_size=3,
)


def _bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    fields = st.fixed_dictionaries({}, optional=_sampling)
    completion = st.tuples(st.just("completions"), fields, _prompt).map(
        lambda t: (t[0], {"model": "tiny", **t[1], "prompt": t[2]})
    )
    chat = st.tuples(st.just("chat/completions"), fields, _messages).map(
        lambda t: (t[0], {"model": "tiny", **t[1], "messages": t[2]})
    )
    return st.one_of(completion, chat)


@pytest.mark.slow
@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_bodies())
def test_fuzzed_requests_never_5xx_hang_or_kill_a_worker(
    server: ServedGateway, case: tuple[str, dict[str, Any]]
) -> None:
    path, body = case
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and 64 < max_tokens < 2**20:
        body["max_tokens"] = 64  # keep the run short; huge values still go out as they are
    content = json.dumps(body, allow_nan=True).encode()  # NaN / Infinity travel as such
    workers = set(server.svc.controller.workers())
    r = httpx.post(
        f"{server.base_url}/v1/{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code == 200 and body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    assert set(server.svc.controller.workers()) == workers, body
