"""Who may ask, and how much: API keys (``keys.py``) and their limits (``limits.py``) at the HTTP edge.

    authenticate(request)            FastAPI dependency: 401, or the caller's KeyEntry
                                     kept on ``request.state``
    run(request, gen, answer)        429 over the key's limits; else ``answer(on_finish)``,
                                     with x-ratelimit-* headers on the response

Keys come from ``gateway.api_keys_file`` (names -> salted hashes + limits) and
``gateway.api_key`` (one key named ``default``, no limits); with neither, every
request is let in. Counters go to ``/metrics`` by the key's name. Nothing here
logs a key, a prompt or a completion.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from services.config import GatewayConfig
from services.gateway.errors import RateLimited, Unauthorized
from services.gateway.keys import KeyEntry, KeyTable, load_key_table
from services.gateway.limits import Limited, RateLimiter, RateLimitStatus
from services.gateway.prepare import Generation
from services.metrics import BatonMetrics

__all__ = ["AccessGate", "key_table", "rate_limit_headers"]

# answer(on_finish) -> the response; on_finish(num_completion_tokens) is called once, at the end.
Answer = Callable[[Callable[[int], None]], Awaitable[Response]]


def key_table(gateway: GatewayConfig) -> KeyTable:
    """The keys of ``gateway.api_keys_file`` and ``gateway.api_key`` together."""
    entries: tuple[KeyEntry, ...] = ()
    if gateway.api_keys_file:
        entries += load_key_table(gateway.api_keys_file).entries
    if gateway.api_key:
        entries += KeyTable.single(gateway.api_key).entries
    return KeyTable(entries)


class AccessGate:
    def __init__(
        self,
        keys: KeyTable,
        metrics: BatonMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = keys
        self.limiter = RateLimiter()
        self._metrics = metrics
        self._clock = clock

    async def authenticate(self, request: Request) -> None:
        # async: FastAPI runs a plain ``def`` dependency in a thread pool, a hop per request.
        request.state.api_key_entry = None
        if self.keys.is_open:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Bytes: a header may carry any byte, and compare_digest refuses non-ASCII str.
        entry = self.keys.find(token.strip().encode("utf-8", "surrogateescape"))
        if scheme.lower() != "bearer" or entry is None:
            raise Unauthorized("Incorrect API key provided.", None, "invalid_api_key")
        request.state.api_key_entry = entry

    async def run(self, request: Request, gen: Generation, answer: Answer) -> Response:
        key: KeyEntry | None = getattr(request.state, "api_key_entry", None)
        if key is None:
            return await answer(_ignore)
        m, name = self._metrics, key.name
        cost_tokens = gen.num_prompt_tokens + sum(c.sampling.max_tokens for c in gen.choices)
        decision = self.limiter.admit(name, key.limits, cost_tokens, self._clock())
        if isinstance(decision, Limited):
            m.key_rate_limited.labels(name, decision.limit).inc()
            raise RateLimited(
                f"Rate limit reached for key {name!r} ({_limit_text(decision)}); "
                f"try again in {decision.retry_after_s:.1f}s.",
                decision.retry_after_s,
                rate_limit_headers(decision.status),
            )
        m.key_requests.labels(name).inc()
        m.key_prompt_tokens.labels(name).inc(gen.num_prompt_tokens)
        m.key_inflight.labels(name).inc()
        finished = False

        def on_finish(num_completion_tokens: int) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            m.key_generation_tokens.labels(name).inc(num_completion_tokens)
            m.key_inflight.labels(name).dec()
            used = gen.num_prompt_tokens + num_completion_tokens
            self.limiter.finish(decision, used, self._clock())

        try:
            response = await answer(on_finish)
        except BaseException:
            on_finish(0)  # a no-op when the answer already reported
            raise
        response.headers.update(rate_limit_headers(decision.status))
        return response


def _ignore(num_completion_tokens: int) -> None:
    del num_completion_tokens


def _limit_text(limited: Limited) -> str:
    s = limited.status
    match limited.limit:
        case "requests":
            return f"requests per minute: limit {s.limit_requests}"
        case "tokens":
            return f"tokens per minute: limit {s.limit_tokens}"
        case "concurrency":
            return "concurrent requests"


def rate_limit_headers(status: RateLimitStatus) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, for limits the key has."""
    headers: dict[str, str] = {}
    if status.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(status.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(status.remaining_requests)
        headers["x-ratelimit-reset-requests"] = _duration(status.reset_requests_s or 0.0)
    if status.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(status.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(status.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = _duration(status.reset_tokens_s or 0.0)
    return headers


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``120ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest_s = divmod(seconds, 60.0)
    text = f"{rest_s:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
