"""Per-key access over HTTP: 401 for a wrong key, 429 with OpenAI's rate-limit headers for a
key over its limits while other keys go on, per-key counters in /metrics by name only."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from services.gateway.access import AccessGate
from services.gateway.keys import KeyTable, hash_key
from services.gateway.prepare import Generation
from services.metrics import BatonMetrics
from tests.unit.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

ALICE, BOB = "sk-baton-alice-0123456789", "sk-baton-bob-9876543210"
PROMPT = "zebra-quartz-prompt"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _body(max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(
        f"alice: {{hash: '{hash_key(ALICE)}', requests_per_minute: 2}}\n"
        f"bob: {{hash: '{hash_key(BOB)}', tokens_per_minute: 1000}}\n"
    )
    return path


async def test_a_key_over_its_limit_gets_429_with_headers_and_another_key_is_unaffected(
    gateway: Any, key_file: Path
) -> None:
    _, client = await gateway(**{"gateway.api_keys_file": str(key_file)})
    for remaining in ("1", "0"):
        ok = await client.post("/v1/completions", json=_body(), headers=_auth(ALICE))
        assert ok.status_code == 200
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
        assert ok.headers["x-ratelimit-remaining-requests"] == remaining
    limited = await client.post("/v1/completions", json=_body(), headers=_auth(ALICE))
    assert limited.status_code == 429
    error = limited.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == "rate_limit_exceeded"
    assert "alice" in error["message"] and ALICE not in error["message"]
    assert 29 <= int(limited.headers["retry-after"]) <= 30  # 2/min: one back every 30 s
    assert 28_000 < int(limited.headers["retry-after-ms"]) <= 30_000
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.headers["x-ratelimit-reset-requests"].endswith("s")
    for _ in range(3):  # bob has no request limit; his tokens are his own
        other = await client.post("/v1/completions", json=_body(), headers=_auth(BOB))
        assert other.status_code == 200
        assert other.headers["x-ratelimit-limit-tokens"] == "1000"
        assert "x-ratelimit-limit-requests" not in other.headers


async def test_tokens_per_minute_count_the_prompt_and_max_tokens(
    gateway: Any, key_file: Path
) -> None:
    _, client = await gateway(**{"gateway.api_keys_file": str(key_file)})
    r = await client.post(
        "/v1/completions", json=_body(max_tokens=8, stream=True), headers=_auth(BOB)
    )
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1000 - 8 - 1  # charged up front
    codes = []
    for _ in range(4):  # each uses its whole 300 tokens plus the prompt: bob's 1000 run out
        used = await client.post(
            "/v1/completions", json=_body(max_tokens=300, ignore_eos=True), headers=_auth(BOB)
        )
        codes.append(used.status_code)
    assert codes == [200, 200, 200, 429], codes
    assert used.headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(used.headers["x-ratelimit-remaining-tokens"]) < 300
    assert "tokens per minute" in used.json()["error"]["message"]
    assert int(used.headers["retry-after"]) >= 1


async def test_a_wrong_or_missing_key_is_401(gateway: Any, key_file: Path) -> None:
    _, client = await gateway(**{"gateway.api_keys_file": str(key_file)})
    for headers in ({}, _auth("sk-baton-nope"), _auth(ALICE[:-1]), {"Authorization": ALICE}):
        r = await client.post("/v1/completions", json=_body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert (await client.get("/v1/models", headers=_auth(BOB))).status_code == 200


async def test_the_single_api_key_and_a_key_file_together(gateway: Any, key_file: Path) -> None:
    _, client = await gateway(
        **{"gateway.api_keys_file": str(key_file), "gateway.api_key": "sekret"}
    )
    assert (await client.get("/v1/models", headers=_auth("sekret"))).status_code == 200
    assert (await client.get("/v1/models", headers=_auth(ALICE))).status_code == 200


async def test_metrics_count_per_key_name_and_logs_hold_no_key_or_prompt(
    gateway: Any, key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _, client = await gateway(**{"gateway.api_keys_file": str(key_file)})
    for _ in range(3):  # the third is over alice's limit
        await client.post("/v1/completions", json=_body(max_tokens=5), headers=_auth(ALICE))
    await client.post("/v1/completions", json=_body(max_tokens=5), headers=_auth(BOB))
    # Scoring alone (echo, max_tokens 0): the token the engine made is not billed.
    scored = _body(max_tokens=0, echo=True, logprobs=0)
    assert (await client.post("/v1/completions", json=scored, headers=_auth(BOB))).is_success
    await client.post("/v1/completions", json=_body(), headers=_auth("sk-baton-wrong"))
    text = (await client.get("/metrics")).text
    assert 'baton_key_requests_total{key="alice"} 2.0' in text
    assert 'baton_key_requests_total{key="bob"} 2.0' in text
    assert 'baton_key_rate_limited_total{key="alice",limit="requests"} 1.0' in text
    assert 'baton_key_generation_tokens_total{key="alice"} 10.0' in text
    assert 'baton_key_generation_tokens_total{key="bob"} 5.0' in text
    assert 'baton_key_inflight_requests{key="alice"} 0.0' in text
    prompt_line = next(
        x for x in text.splitlines() if x.startswith('baton_key_prompt_tokens_total{key="bob"}')
    )
    assert float(prompt_line.split()[-1]) > 0
    for secret in (ALICE, BOB, "sk-baton-wrong", PROMPT):
        assert secret not in text
        assert secret not in caplog.text


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []})


async def test_concurrent_requests_over_the_cap_are_429_until_one_finishes() -> None:
    table = KeyTable.from_mapping(
        {"carol": {"hash": hash_key("sk-carol"), "max_concurrent_requests": 1}}
    )
    gate = AccessGate(table, BatonMetrics())
    requests = [_request() for _ in range(3)]
    for r in requests:
        r.state.api_key_entry = table.entries[0]
    gen = Generation(
        endpoint="completion",
        formatter=None,  # type: ignore[arg-type]  # unused by the gate
        choices=(),
        num_prompt_tokens=3,
        stream=False,
        continuous_usage=False,
        logprobs=False,
    )
    release = asyncio.Event()

    async def slow_answer(on_finish: Any) -> Response:
        await release.wait()
        on_finish(1)
        return JSONResponse({})

    async def fast_answer(on_finish: Any) -> Response:
        on_finish(1)
        return JSONResponse({})

    first = asyncio.create_task(gate.run(requests[0], gen, slow_answer))
    await asyncio.sleep(0)
    from services.gateway.errors import RateLimited

    with pytest.raises(RateLimited) as info:
        await gate.run(requests[1], gen, fast_answer)
    assert info.value.headers()["Retry-After"] == "1"
    release.set()
    await first
    assert (await gate.run(requests[2], gen, fast_answer)).status_code == 200
    assert gate.limiter.num_inflight("carol") == 0


async def test_a_key_removed_from_the_file_is_refused_within_a_second_without_a_restart(
    gateway: Any, key_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    _, client = await gateway(**{"gateway.api_keys_file": str(key_file)})
    assert (await client.get("/v1/models", headers=_auth(BOB))).status_code == 200
    assert main(["keys", "remove", "bob", "--file", str(key_file)]) == 0
    await asyncio.sleep(1.05)  # the file's status is looked at once a second at most
    refused = await client.get("/v1/models", headers=_auth(BOB))
    assert refused.status_code == 401
    assert (await client.get("/v1/models", headers=_auth(ALICE))).status_code == 200
    # A key added meanwhile is taken the same way.
    assert main(["keys", "add", "carol", "--file", str(key_file)]) == 0
    carol = capsys.readouterr().out.strip()
    await asyncio.sleep(1.05)
    assert (await client.get("/v1/models", headers=_auth(carol))).status_code == 200
