"""Who may ask, and how much: API keys (``keys.py``) and their limits (``limits.py``) at the HTTP edge.

    authenticate(request)            FastAPI dependency: 401, or the caller's KeyEntry
                                     kept on ``request.state``
    run(request, gen, answer)        429 over the key's limits; else ``answer(on_finish)``,
                                     with x-ratelimit-* headers on the response

Keys come from ``gateway.api_keys_file`` (names -> salted hashes + limits) and
``gateway.api_key`` (one key named ``default``, no limits); with neither, every
request is let in. Counters go to ``/metrics`` by the key's name. Nothing here
logs a key, a prompt or a completion.

The key file is read again when it changes (``KeyFile``: its status looked at once a
second at most, from the requests themselves): a key added, removed (``baton keys
remove``) or given new limits takes effect without a restart, on every gateway that
reads the file (a Kubernetes Secret's update reaches the mounted file by itself). A
file changed into one the gateway would refuse keeps the keys it had, and says so in
the log once per change.
"""

from __future__ import annotations

import logging
import math
import os
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

__all__ = ["AccessGate", "KeyFile", "key_table", "rate_limit_headers"]

log = logging.getLogger("baton.access")

# answer(on_finish) -> the response; on_finish(num_completion_tokens) is called once, at the end.
Answer = Callable[[Callable[[int], None]], Awaitable[Response]]


def key_table(gateway: GatewayConfig) -> KeyTable:
    """The keys of ``gateway.api_keys_file`` and ``gateway.api_key`` together."""
    entries: tuple[KeyEntry, ...] = ()
    if gateway.api_keys_file:
        entries += load_key_table(gateway.api_keys_file).entries
        if not entries:
            raise ValueError(
                f"{gateway.api_keys_file}: no keys; every request would be refused "
                "(`baton keys add NAME --file ...` makes one)"
            )
    if gateway.api_key:
        entries += KeyTable.single(gateway.api_key).entries
    return KeyTable(entries)


class KeyFile:
    """The gateway's keys, read again from ``gateway.api_keys_file`` when the file's
    status (modification time, size, inode) changes; looked at once per ``every_s`` at
    most. The single ``gateway.api_key`` is hashed once and kept."""

    def __init__(
        self,
        gateway: GatewayConfig,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = 1.0,
    ) -> None:
        self.path = gateway.api_keys_file
        self._single = KeyTable.single(gateway.api_key).entries if gateway.api_key else ()
        self._clock = clock
        self._every_s = every_s
        self._status = self._stat()
        file_entries = load_key_table(self.path).entries if self.path else ()
        # With a key file, a key is required even when the file lists none (all removed).
        self.table = KeyTable(file_entries + self._single, closed=self.path is not None)
        self._next_s = clock() + every_s

    def current(self) -> KeyTable:
        """The table as the file is now (at most ``every_s`` old)."""
        if self.path is None:
            return self.table
        now = self._clock()
        if now < self._next_s:
            return self.table
        self._next_s = now + self._every_s
        status = self._stat()
        if status != self._status:
            self._status = status
            self._reload()
        return self.table

    def _stat(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self) -> None:
        try:
            entries = load_key_table(self.path).entries if self.path else ()
            table = KeyTable(entries + self._single, closed=True)
        except (OSError, ValueError) as e:  # the entry and field, or the place: never a hash
            log.error("key file %s not reloaded, the keys stay as they were: %s", self.path, e)
            return
        before = {e.name for e in self.table.entries}
        after = {e.name for e in table.entries}
        self.table = table
        log.info(
            "key file %s reloaded: %d keys (added %s, removed %s)",
            self.path,
            len(after),
            sorted(after - before) or "none",
            sorted(before - after) or "none",
        )


class AccessGate:
    def __init__(
        self,
        keys: KeyTable | KeyFile,
        metrics: BatonMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = keys
        self.limiter = RateLimiter()
        self._metrics = metrics
        self._clock = clock

    @property
    def keys(self) -> KeyTable:
        """The keys as they are now (a ``KeyFile``'s, read again when it changed)."""
        keys = self._keys
        return keys if isinstance(keys, KeyTable) else keys.current()

    async def authenticate(self, request: Request) -> None:
        # async: FastAPI runs a plain ``def`` dependency in a thread pool, a hop per request.
        request.state.api_key_entry = None
        keys = self.keys
        if keys.is_open:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Bytes: a header may carry any byte, and compare_digest refuses non-ASCII str.
        entry = keys.find(token.strip().encode("utf-8", "surrogateescape"))
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
