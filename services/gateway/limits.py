"""Per-key rate limits: requests and tokens per minute, and concurrent requests.

Call order, per request of one key:

    admit(name, limits, cost_tokens, now_s)  -> Admitted, or Limited (answer 429)
    ... the request runs ...
    finish(admitted, num_tokens_used, now_s) exactly once

Requests and tokens per minute are token buckets that start full and refill
continuously (a limit of 60 per minute is one per second, with bursts up to 60).
A request is charged its prompt tokens plus every choice's ``max_tokens`` when
admitted (as OpenAI counts), and what it did not use goes back at ``finish``. A
request costing more than the whole bucket waits for a full one and leaves it in
debt, so one huge request cannot pass the limit twice. The clock is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.gateway.keys import KeyLimits

__all__ = ["Admitted", "Limited", "RateLimitStatus", "RateLimiter"]

LimitKind = Literal["requests", "tokens", "concurrency"]

_CONCURRENCY_RETRY_S = 1.0  # when a slot frees is not known; ask again soon


@dataclass(slots=True)
class _Bucket:
    capacity: float
    level: float
    updated_s: float

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def refill(self, now_s: float) -> None:
        elapsed_s = max(0.0, now_s - self.updated_s)
        self.level = min(self.capacity, self.level + elapsed_s * self.rate_per_s)
        self.updated_s = now_s

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def seconds_until_full(self) -> float:
        return self.seconds_until(self.capacity)


@dataclass(slots=True)
class _KeyState:
    requests: _Bucket | None
    tokens: _Bucket | None
    num_inflight: int = 0


@dataclass(frozen=True, slots=True)
class RateLimitStatus:
    """What OpenAI's ``x-ratelimit-*`` headers say; None where the key has no such limit."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    name: str
    charged_tokens: int
    status: RateLimitStatus


@dataclass(frozen=True, slots=True)
class Limited:
    name: str
    limit: LimitKind
    retry_after_s: float
    status: RateLimitStatus


class RateLimiter:
    """The limits' state of every key, by name; one per gateway process."""

    def __init__(self) -> None:
        self._states: dict[str, _KeyState] = {}

    def admit(
        self, name: str, limits: KeyLimits, cost_tokens: int, now_s: float
    ) -> Admitted | Limited:
        state = self._state(name, limits, now_s)
        waits: list[tuple[float, LimitKind]] = []
        cap = limits.max_concurrent_requests
        if cap is not None and state.num_inflight >= cap:
            waits.append((_CONCURRENCY_RETRY_S, "concurrency"))
        if state.requests is not None and state.requests.level < 1:
            waits.append((state.requests.seconds_until(1), "requests"))
        if state.tokens is not None:
            needed = min(float(cost_tokens), state.tokens.capacity)
            if state.tokens.level < needed:
                waits.append((state.tokens.seconds_until(needed), "tokens"))
        if waits:
            retry_after_s, kind = max(waits)
            return Limited(name, kind, retry_after_s, _status(state))
        if state.requests is not None:
            state.requests.level -= 1
        if state.tokens is not None:
            state.tokens.level -= cost_tokens
        state.num_inflight += 1
        return Admitted(name, cost_tokens, _status(state))

    def finish(self, admitted: Admitted, num_tokens_used: int, now_s: float) -> None:
        state = self._states[admitted.name]
        state.num_inflight -= 1
        if state.tokens is not None:
            state.tokens.refill(now_s)
            unused = max(0, admitted.charged_tokens - num_tokens_used)
            state.tokens.level = min(state.tokens.capacity, state.tokens.level + unused)

    def num_inflight(self, name: str) -> int:
        state = self._states.get(name)
        return state.num_inflight if state is not None else 0

    def _state(self, name: str, limits: KeyLimits, now_s: float) -> _KeyState:
        state = self._states.get(name)
        if state is None:
            state = _KeyState(
                _bucket(limits.requests_per_minute, now_s), _bucket(limits.tokens_per_minute, now_s)
            )
            self._states[name] = state
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now_s)
        return state


def _bucket(per_minute: int | None, now_s: float) -> _Bucket | None:
    return None if per_minute is None else _Bucket(float(per_minute), float(per_minute), now_s)


def _status(state: _KeyState) -> RateLimitStatus:
    r, t = state.requests, state.tokens
    return RateLimitStatus(
        limit_requests=int(r.capacity) if r else None,
        remaining_requests=max(0, int(r.level)) if r else None,
        reset_requests_s=r.seconds_until_full() if r else None,
        limit_tokens=int(t.capacity) if t else None,
        remaining_tokens=max(0, int(t.level)) if t else None,
        reset_tokens_s=t.seconds_until_full() if t else None,
    )
