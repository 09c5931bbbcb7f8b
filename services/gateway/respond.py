"""Running a Generation and answering: SSE chunks or one JSON body, usage, metrics.

    run          one executor stream per choice (prompts x n), merged as they come
    respond      SSE chunks, or one JSON body; usage; metrics per choice

Placement errors (429) happen before the first byte: a stream's first event is
awaited before the response starts, so the status code can still say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from services.gateway.errors import APIError, Overloaded
from services.gateway.openai_format import DONE, LogprobsAcc, sse, usage
from services.gateway.prepare import Generation
from services.gateway.service import GatewayService
from services.gateway.shaping import ChoiceShaper, StreamDelta
from services.gateway.streaming import BoundedStreamingResponse
from services.workers.messages import TokenDelta

__all__ = ["respond"]

_DISCONNECT_POLL_S = 0.25


class _ChoiceMetrics:
    def __init__(self, svc: GatewayService, arrival_s: float) -> None:
        self._m = svc.metrics
        self._model = svc.model_name
        self._arrival_s = arrival_s
        self._first_s: float | None = None
        self._last_s = arrival_s
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # the prompt's, served from a prefix cache

    def on_delta(self, delta: TokenDelta) -> None:
        now = time.monotonic()
        if self._first_s is None:
            self._first_s = now
            self._m.ttft_s.labels(self._model).observe(now - self._arrival_s)
            # From the worker that computed the prompt (later deltas: a decode worker's).
            self.num_cached_tokens = delta.num_cached_tokens
        else:
            self._m.itl_s.labels(self._model).observe(now - self._last_s)
        self._last_s = now
        self.num_output_tokens = delta.num_output_tokens

    def on_finish(self, num_prompt_tokens: int) -> None:
        m, model = self._m, self._model
        m.e2e_s.labels(model).observe(self._last_s - self._arrival_s)
        if self._first_s is not None and self.num_output_tokens > 1:
            tpot = (self._last_s - self._first_s) / (self.num_output_tokens - 1)
            m.tpot_s.labels(model).observe(tpot)
        m.prompt_tokens.labels(model).inc(num_prompt_tokens)
        m.prompt_cached_tokens.labels(model).inc(self.num_cached_tokens)
        m.generation_tokens.labels(model).inc(self.num_output_tokens)


async def _merge(
    streams: Sequence[AsyncGenerator[TokenDelta, None]],
) -> AsyncGenerator[tuple[int, TokenDelta], None]:
    """Items of several streams as they arrive, tagged with the stream's position."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:  # aborts it, if left early
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, TokenDelta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[TokenDelta]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, maybe_item, error = await queue.get()
            if error is not None:
                raise error
            if maybe_item is None:
                remaining -= 1
            else:
                yield i, maybe_item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(
    svc: GatewayService, gen: Generation, arrival_s: float
) -> AsyncGenerator[tuple[int, TokenDelta], None]:
    streams = [
        svc.generate(
            c.request_id,
            c.prompt_token_ids,
            c.sampling,
            arrival_s,
            slo=gen.slo,
            priority=gen.priority,
            images=gen.images,
        )
        for c in gen.choices
    ]
    async with contextlib.aclosing(_merge(streams)) as merged:
        async for item in merged:
            yield item


def _no_report(num_completion_tokens: int) -> None:
    del num_completion_tokens


async def respond(
    svc: GatewayService,
    gen: Generation,
    request: Request,
    on_finish: Callable[[int], None] = _no_report,
) -> Any:
    """Answer ``gen``; ``on_finish(num_completion_tokens)`` is called at most once, when the
    answer ends; a caller that sees ``respond`` raise must not count on it."""
    if not svc.try_admit():
        _count(svc, "rejected", len(gen.choices))
        raise Overloaded("too many requests in flight", 1.0)
    arrival_s = time.monotonic()
    events = _events(svc, gen, arrival_s)
    try:
        first = await anext(events)  # placement errors become HTTP statuses here
    except StopAsyncIteration:
        first = None
    except BaseException as e:
        svc.finish()
        on_finish(0)
        await events.aclose()
        outcome = {Overloaded: "rejected", asyncio.CancelledError: "aborted"}.get(type(e), "error")
        _count(svc, outcome, len(gen.choices))
        raise
    if gen.stream:
        return BoundedStreamingResponse(
            _stream_body(svc, gen, events, first, arrival_s, on_finish),
            write_timeout_s=svc.settings.gateway.stream_write_timeout_s,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    timers = [_ChoiceMetrics(svc, arrival_s) for _ in gen.choices]
    try:
        return await _until_disconnect(_collect(svc, gen, events, first, timers), request)
    finally:
        svc.finish()
        on_finish(_completion_tokens(gen, timers))


def _count(svc: GatewayService, outcome: str, n: int = 1) -> None:
    svc.metrics.requests.labels(svc.model_name, outcome).inc(n)


async def _until_disconnect(coro: Any, request: Request) -> Any:
    """Await ``coro``; cancel it (aborting its requests) if the client hangs up."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return JSONResponse({"error": "client disconnected"}, status_code=499)
    finally:
        if not task.done():
            task.cancel()


async def _collect(
    svc: GatewayService,
    gen: Generation,
    events: AsyncIterator[tuple[int, TokenDelta]],
    first: tuple[int, TokenDelta] | None,
    timers: Sequence[_ChoiceMetrics],
) -> JSONResponse:
    n = len(gen.choices)
    texts = [""] * n
    finish: list[str | None] = [None] * n
    accs = _logprobs_accs(gen)
    echo_scores = _EchoScores(svc, gen, accs)

    def take(i: int, d: TokenDelta) -> None:
        timers[i].on_delta(d)
        echo_scores.add(i, d)
        d = _shown(gen, d)
        texts[i] += d.text
        if d.logprobs:
            accs[i].add(svc.tokenizer, d.logprobs)
        if d.finish_reason is not None:
            finish[i] = d.finish_reason.value

    try:
        if first is not None:
            take(*first)
        async for i, d in events:
            take(i, d)
    except APIError:
        _count(svc, "error", n)
        raise
    except asyncio.CancelledError:  # the client hung up
        _count(svc, "aborted", n)
        raise
    for i, c in enumerate(gen.choices):
        timers[i].on_finish(len(c.prompt_token_ids))
        if gen.echo_texts:
            texts[i] = gen.echo_texts[c.prompt_index] + texts[i]
    _count(svc, "success", n)
    messages: list[dict[str, Any] | None] = [None] * n
    if gen.endpoint == "chat" and not gen.shape.is_plain:
        for i in range(n):
            messages[i], finish[i] = ChoiceShaper(gen.shape).whole(texts[i], finish[i])
    body = gen.formatter.response(
        [(texts[i], finish[i], accs[i].render() if gen.logprobs else None) for i in range(n)],
        _running_usage(gen, timers),
        messages,
    )
    return JSONResponse(body)


async def _stream_body(
    svc: GatewayService,
    gen: Generation,
    events: AsyncGenerator[tuple[int, TokenDelta], None],
    first: tuple[int, TokenDelta] | None,
    arrival_s: float,
    on_finish: Callable[[int], None],
) -> AsyncIterator[bytes]:
    fmt = gen.formatter
    n = len(gen.choices)
    timers = [_ChoiceMetrics(svc, arrival_s) for _ in range(n)]
    shapers = None
    if gen.endpoint == "chat" and not gen.shape.is_plain:
        shapers = [ChoiceShaper(gen.shape) for _ in range(n)]
    accs = _logprobs_accs(gen)
    echo_scores = _EchoScores(svc, gen, accs)
    outcome = "aborted"
    try:
        for c in gen.choices:
            usage_now = _running_usage(gen, timers) if gen.continuous_usage else None
            if gen.endpoint == "chat":
                yield sse(fmt.chunk(c.index, "", None, first=True, usage_now=usage_now))
            elif gen.echo_texts and not echo_scores.due(c.index):
                yield sse(fmt.chunk(c.index, gen.echo_texts[c.prompt_index], None))
        pending = [first] if first is not None else []
        async for item in _chain(pending, events):
            i, d = item
            if echo_scores.add(i, d):  # the echo waited for them
                echo = gen.echo_texts[gen.choices[i].prompt_index]
                yield sse(fmt.chunk(i, echo, None, accs[i].take()))
            timers[i].on_delta(d)
            d = _shown(gen, d)
            logprobs = None
            if gen.logprobs and d.logprobs:
                accs[i].add(svc.tokenizer, d.logprobs)
                logprobs = accs[i].take()
            finish = d.finish_reason.value if d.finish_reason is not None else None
            shaped = StreamDelta(content=d.text, finish_reason=finish)
            if shapers is not None:  # reasoning, tool calls: split out of the text
                shaped = shapers[i].delta(d.text, finish)
            # One event per engine delta that carries tokens, even while the detokenizer
            # holds text back (a partial UTF-8 character, a possible stop string): clients
            # time TTFT and inter-token latency per event, as vLLM's harness does.
            if not d.text and not d.token_ids and finish is None and logprobs is None:
                continue
            usage_now = _running_usage(gen, timers) if gen.continuous_usage else None
            yield sse(
                fmt.chunk(
                    i,
                    shaped.content,
                    shaped.finish_reason,
                    logprobs,
                    usage_now=usage_now,
                    tool_calls=shaped.tool_calls,
                    reasoning=shaped.reasoning,
                )
            )
        for i, c in enumerate(gen.choices):
            timers[i].on_finish(len(c.prompt_token_ids))
        if fmt.include_usage:
            yield sse(fmt.usage_chunk(_running_usage(gen, timers)))
        outcome = "success"
        yield DONE
    except APIError as e:
        outcome = "error"
        yield sse(e.body())
        yield DONE
    finally:
        _count(svc, outcome, n)
        svc.finish()
        on_finish(_completion_tokens(gen, timers))
        await events.aclose()


class _EchoScores:
    """An echoed prompt's logprobs (echo with logprobs): each choice's go into its
    logprobs before its outputs', from its first delta, which carries them."""

    def __init__(self, svc: GatewayService, gen: Generation, accs: list[LogprobsAcc]) -> None:
        self._tokenizer = svc.tokenizer
        self._choices = gen.choices
        self._accs = accs
        self._due = [gen.prompt_logprobs] * len(gen.choices)

    def due(self, i: int) -> bool:
        return self._due[i]

    def add(self, i: int, d: TokenDelta) -> bool:
        """Add choice ``i``'s from ``d`` if still due; whether they were."""
        if not self._due[i]:
            return False
        self._due[i] = False
        prompt = self._choices[i].prompt_token_ids
        self._accs[i].add_prompt(self._tokenizer, prompt, d.prompt_logprobs)
        return True


def _logprobs_accs(gen: Generation) -> list[LogprobsAcc]:
    """One per choice. An echoed prompt comes first in the text: with logprobs its
    tokens come first in them too (``LogprobsAcc.add_prompt``), so offsets start at 0."""
    echo = gen.echo_texts
    return [
        LogprobsAcc(gen.endpoint, chars=len(echo[c.prompt_index]) if echo else 0)
        if not gen.prompt_logprobs
        else LogprobsAcc(gen.endpoint)
        for c in gen.choices
    ]


def _running_usage(gen: Generation, timers: Sequence[_ChoiceMetrics]) -> dict[str, Any]:
    return usage(
        gen.num_prompt_tokens, _completion_tokens(gen, timers), _cached_tokens(gen, timers)
    )


def _cached_tokens(gen: Generation, timers: Sequence[_ChoiceMetrics]) -> int:
    """Each prompt once, as ``prompt_tokens`` counts it: the fewest of its tokens any of
    its choices found cached (choices are separate requests: never over-claimed)."""
    fewest: dict[int, int] = {}
    for c, t in zip(gen.choices, timers, strict=True):
        fewest[c.prompt_index] = min(
            fewest.get(c.prompt_index, t.num_cached_tokens), t.num_cached_tokens
        )
    return sum(fewest.values())


def _completion_tokens(gen: Generation, timers: Sequence[_ChoiceMetrics]) -> int:
    return 0 if gen.echo_only else sum(t.num_output_tokens for t in timers)


def _shown(gen: Generation, d: TokenDelta) -> TokenDelta:
    """The delta as the client sees it: with ``echo_only``, no generated token (its
    finish reason stays: ``length``)."""
    if not gen.echo_only:
        return d
    return replace(d, text="", token_ids=(), logprobs=None)


async def _chain(
    head: list[tuple[int, TokenDelta]], rest: AsyncIterator[tuple[int, TokenDelta]]
) -> AsyncIterator[tuple[int, TokenDelta]]:
    for item in head:
        yield item
    async for item in rest:
        yield item
