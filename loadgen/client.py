"""Async streaming client for OpenAI-compatible servers, timing every SSE event.

``send_request`` posts one streamed request and returns a ``RequestRecord``:
TTFT is the first event carrying a token (text, possibly empty while the
server holds it back, or the final chunk), each later one adds an inter-token
latency, e2el ends after ``data: [DONE]``. Token counts come from
the server's ``usage`` (asked for with ``stream_options.include_usage``); when
a server sends none, the output count falls back to the number of text events.
``ignore_eos: true`` is sent so output lengths are what the workload asked for.

``run_bench(config)`` drives a whole run (open loop on arrival times, or
closed loop at a concurrency) and returns the summary and the records.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loadgen.arrivals import RateSpec
from loadgen.images import image_parts
from loadgen.metrics import GoodputSLO, RequestRecord, compute_summary
from loadgen.scenario import Tokenizer, WorkloadConfig, build_requests, synthetic_prompt
from loadgen.workload import RequestSpec, WorkloadError

__all__ = [
    "BenchConfig",
    "BenchResult",
    "ModelNotServed",
    "client_api_key",
    "run_bench",
    "send_request",
    "served_model",
]

EndpointKind = Literal["chat", "completions"]
Progress = Callable[[int, int, int], None]  # (done, failed, total)


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    rate: RateSpec | None = None  # None: closed loop at ``concurrency``
    concurrency: int | None = None
    model: str | None = None  # None: the first of /v1/models
    endpoint: EndpointKind = "completions"
    slo: GoodputSLO | None = None
    timeout_s: float = 600.0
    api_key: str = "EMPTY"
    tokenizer: Tokenizer | None = None  # the target's: prompt lengths in its tokens


@dataclass(frozen=True)
class BenchResult:
    summary: dict[str, Any]
    records: list[RequestRecord]


def _payload(
    kind: EndpointKind, model: str, spec: RequestSpec, tokenizer: Tokenizer | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    prompt = synthetic_prompt(spec, tokenizer)
    if kind == "chat" and spec.image_sides:
        parts = [*image_parts(spec.request_id, spec.image_sides), {"type": "text", "text": prompt}]
        body["messages"] = [{"role": "user", "content": parts}]
    elif kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _carries_token(chunk: dict[str, Any]) -> bool:
    """Every event that delivers a token counts, its text empty or not: a byte-level
    detokenizer holds back an incomplete UTF-8 character (and a server holds back a
    possible stop string), yet the token was generated and its event sent then, so
    TTFT and inter-token latency time it (as vLLM's harness does for completions).
    A chat stream's opening chunk (``delta: {role, content: ""}``) comes before any
    token and does not count; nor does the usage chunk (no choices)."""
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if "content" in delta and "role" not in delta:
                return True
        elif isinstance(choice.get("text"), str):
            return True
    return False


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    kind: EndpointKind,
    model: str,
    spec: RequestSpec,
    run_start_s: float,
    tokenizer: Tokenizer | None = None,
) -> RequestRecord:
    clock = time.perf_counter
    sent = clock()
    start_s = sent - run_start_s
    ttft: float | None = None
    last = sent
    itls: list[float] = []
    usage: dict[str, Any] | None = None
    num_events = 0
    status: int | None = None
    try:
        async with client.stream("POST", url, json=_payload(kind, model, spec, tokenizer)) as resp:
            status = resp.status_code
            if status != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestRecord(
                    spec.request_id,
                    False,
                    start_s,
                    e2el_s=clock() - sent,  # how long the refusal took
                    status=status,
                    error=_error_text(body),
                )
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestRecord(
                        spec.request_id, False, start_s, status=status, error=_error_text(data)
                    )
                now = clock()
                if _carries_token(chunk):
                    num_events += 1
                    if ttft is None:
                        ttft = now - sent
                    else:
                        itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestRecord(spec.request_id, False, start_s, status=status, error=repr(e))
    e2el = clock() - sent
    if ttft is None:
        return RequestRecord(
            spec.request_id, False, start_s, status=status, error="no tokens streamed"
        )
    return RequestRecord(
        spec.request_id,
        True,
        start_s,
        ttft_s=ttft,
        e2el_s=e2el,
        itl_s=tuple(itls),
        prompt_tokens=int(usage["prompt_tokens"]) if usage else spec.input_len,
        output_tokens=int(usage["completion_tokens"]) if usage else num_events,
        status=status,
    )


def _error_text(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body[:500]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])[:500]
    return str(err)[:500]


def client_api_key(path: str | None, environ: Mapping[str, str]) -> str:
    """The bearer key a load generator sends: the one in ``path`` (``--api-key-file``),
    else ``$BATON_API_KEY``, else ``$OPENAI_API_KEY``, else ``EMPTY`` (a server without
    keys ignores it). Never a command-line value, where any user's ``ps`` shows it. The
    file and ``$BATON_API_KEY`` are read as ``baton serve`` reads them."""
    from services.cluster.serve import api_key

    return api_key(path, dict(environ)) or environ.get("OPENAI_API_KEY") or "EMPTY"


class ModelNotServed(ValueError):
    """``--model`` names a model the server does not list: every request would be a 404."""


async def served_model(client: httpx.AsyncClient, base_url: str, wanted: str | None) -> str:
    """``wanted``, once ``/v1/models`` lists it, or the first model listed (None)."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    served = [str(m["id"]) for m in resp.json().get("data") or []]
    if not served:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    if wanted is None:
        return served[0]
    if wanted not in served:
        raise ModelNotServed(f"{base_url} does not serve {wanted!r}; it serves {', '.join(served)}")
    return wanted


async def run_bench_async(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    specs = build_requests(config.workload, config.rate)
    if config.endpoint != "chat" and any(s.image_sides for s in specs):
        raise WorkloadError("image requests need the chat endpoint (--endpoint chat)")
    base = config.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if config.endpoint == "chat" else f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    headers = {"Authorization": f"Bearer {config.api_key}"}
    records: list[RequestRecord] = []

    def done(record: RequestRecord) -> None:
        records.append(record)
        if progress is not None:
            progress(len(records), sum(not r.success for r in records), len(specs))

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        model = await served_model(client, base, config.model)
        run_start = time.perf_counter()

        async def one(spec: RequestSpec) -> None:
            record = await send_request(
                client, url, config.endpoint, model, spec, run_start, config.tokenizer
            )
            done(record)

        if config.rate is not None:
            tasks = []
            for spec in specs:
                delay = run_start + spec.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(spec)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(specs)
            width = max(1, config.concurrency or 1)

            async def worker() -> None:
                for spec in queue:  # the shared iterator hands each spec out once
                    await one(spec)

            await asyncio.gather(*(worker() for _ in range(width)))
        duration = time.perf_counter() - run_start
    summary = compute_summary(records, duration, config.slo)
    summary |= {
        "mode": "bench",
        "base_url": base,
        "model": model,
        "endpoint": config.endpoint,
        "rate": config.rate.label if config.rate else None,
        "concurrency": config.concurrency,
        "burstiness": config.workload.burstiness,
        "num_requests": len(specs),
    }
    records.sort(key=lambda r: r.start_s)
    return BenchResult(summary, records)


def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run a load test to completion (blocking)."""
    return asyncio.run(run_bench_async(config, progress))
