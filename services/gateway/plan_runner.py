"""One placement of a request, run on its workers: the plan's worker streams as one.

    encode         a plan with an encode worker (a request with images): Encode on it
                   -> a handle on the embeddings it holds; the prefilling worker
                   pulls them (Generate(request, images=handle)) before it prefills.
                   A plan that splits the images over several encode workers sends
                   each its part at once; the prefilling worker pulls every part
                   (``more_images``) and starts when the last has landed.
                   Without one the prefilling worker encodes the images itself
    colocated      Generate(request) on one worker; stream its deltas (a
                   continuation after a failure runs where decoding would have run)
    disaggregated  Generate(prefill_only) on the prefill worker -> first token
                   (streamed at once) + BlockHandle; Continue(request, handle)
                   on the decode worker, which pulls the KV and decodes

Each worker's reservation in the router ends at its first event (its telemetry
counts the request from then on). A worker's failure ends the run as an exception:
``WorkerDiedError``, ``BadRequest`` (the request is invalid) or ``AttemptFailed``
(anything else; the executor places the request again, executor.py). Every worker
the run touched is told to abort the request if it does not end normally (client
hung up, error): its blocks, held ones included, and embeddings are freed. A
finished KV pull is reported to the router (``observe_transfer``) so that it prices
links as they perform.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

from kvtransfer.types import BlockHandle
from router.front_door import Router
from router.types import Plan
from services.engine.messages import EngineRequest, FinishReason, ImageInput, SamplingParams
from services.gateway.errors import BadRequest
from services.gateway.placement import unreserve
from services.metrics import BatonMetrics
from services.workers.client import WorkerClient, WorkerDiedError
from services.workers.messages import (
    Continue,
    Encode,
    FailureKind,
    Generate,
    ImagesEncoded,
    ImagesPulled,
    Job,
    KVPulled,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
)

__all__ = ["Attempt", "AttemptFailed", "PlanRunner"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class AttemptFailed(Exception):
    """The placement failed: place the request again. ``reason`` labels the retry (a
    worker's ``FailureKind`` value, or ``stream_ended``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Attempt:
    """One placement of a request: its reservation in the router (``placed_id``), its
    id on the workers (``request_id``: attempts differ) and what it asks; ``generated``:
    the tokens already sent (a continuation after a failure)."""

    placed_id: str
    request_id: str
    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    sampling: SamplingParams
    images: tuple[ImageInput, ...]

    def engine_request(
        self,
        images: tuple[ImageInput, ...] | None = None,
        output_token_ids: tuple[int, ...] = (),
        prefill_only: bool = False,
    ) -> EngineRequest:
        return EngineRequest(
            self.request_id,
            self.prompt,
            self.sampling,
            output_token_ids=output_token_ids,
            prefill_only=prefill_only,
            images=self.images if images is None else images,
        )


class PlanRunner:
    """Runs a placement's plan on the workers it names (``run``), for the executor."""

    def __init__(
        self,
        router: Router,
        clients: Callable[[str], WorkerClient | None],
        metrics: BatonMetrics,
        kv_backend: str,
    ) -> None:
        self._router = router
        self._clients = clients
        self._metrics = metrics
        self._kv_backend = kv_backend

    async def run(self, plan: Plan, attempt: Attempt) -> AsyncGenerator[TokenDelta, None]:
        """Run one placement of the request."""
        embeddings: tuple[BlockHandle, ...] = ()
        images = attempt.images
        parts = plan.encode_split(len(images)) if images and not attempt.generated else ()
        try:
            if parts:
                encodes = (self._encode(wid, attempt, images[i:j]) for wid, i, j in parts)
                embeddings = tuple(await _all_or_none(encodes))
            async with aclosing(self._run_plan(plan, attempt, embeddings)) as s:
                async for delta in s:
                    yield delta
        finally:
            for encode_id in dict.fromkeys(wid for wid, _, _ in parts):
                encode_client = self._clients(encode_id)
                if encode_client is not None:  # frees the embeddings if nobody pulled them
                    encode_client.abort(attempt.request_id)

    async def _encode(
        self, encode_id: str, attempt: Attempt, images: tuple[ImageInput, ...]
    ) -> BlockHandle:
        """Encode ``images`` on ``encode_id``; the handle of the embeddings it holds."""
        client = self._clients(encode_id)
        if client is None:
            raise WorkerDiedError(encode_id, "not in the registry")
        request_id = attempt.request_id
        started_s = time.monotonic()
        events = client.generate(Encode(attempt.engine_request(images)))
        try:
            async for event in events:
                self._router.release(attempt.placed_id, encode_id)  # its telemetry counts it
                match event:
                    case ImagesEncoded(handle=handle, duration_s=duration_s):
                        self._metrics.stage_s.labels("encode").observe(time.monotonic() - started_s)
                        num_image_tokens = sum(image.num_tokens for image in images)
                        self._router.observe_encode(encode_id, num_image_tokens, duration_s)
                        return handle
                    case RequestFailed(kind=FailureKind.INVALID, message=message, param=param):
                        raise BadRequest(message, param)
                    case RequestFailed(kind=kind, message=message):
                        log.warning("request %s on %s: %s", request_id, encode_id, message)
                        raise AttemptFailed(kind.value)
        finally:
            await _aclose(events)
        raise AttemptFailed("stream_ended")

    async def _run_plan(
        self, plan: Plan, attempt: Attempt, embeddings: tuple[BlockHandle, ...]
    ) -> AsyncGenerator[TokenDelta, None]:
        generated = attempt.generated
        if plan.colocated or generated:
            # A continuation after a failure runs where decoding would have run.
            worker_id = plan.decode_worker if generated and plan.decode_worker else None
            worker_id = worker_id or plan.prefill_worker
            unreserve(self._router, attempt.placed_id, plan, keep=worker_id)
            job = _generate(attempt.engine_request(output_token_ids=generated), embeddings)
            stream = self._stream(worker_id, job, attempt.placed_id, prefill=True)
            async with aclosing(stream) as s:
                async for delta in s:
                    yield delta
            return
        assert plan.decode_worker is not None
        disaggregated = self._disaggregated(
            plan.prefill_worker, plan.decode_worker, attempt, embeddings
        )
        async with aclosing(disaggregated) as s:
            async for delta in s:
                yield delta

    async def _disaggregated(
        self,
        prefill_id: str,
        decode_id: str,
        attempt: Attempt,
        embeddings: tuple[BlockHandle, ...],
    ) -> AsyncGenerator[TokenDelta, None]:
        placed_id, request_id = attempt.placed_id, attempt.request_id
        completed = False
        try:
            handle = None
            first_tokens: tuple[int, ...] = ()
            prefill_job = _generate(attempt.engine_request(prefill_only=True), embeddings)
            prefill = self._stream(prefill_id, prefill_job, placed_id, prefill=True)
            async with aclosing(prefill) as s:
                async for delta in s:
                    first_tokens += delta.token_ids
                    if delta.finish_reason is FinishReason.PREFILLED:
                        handle = delta.handle
                        delta = replace(delta, finish_reason=None, handle=None)
                    completed = delta.finish_reason is not None  # done at the first token
                    yield delta
            if handle is None:
                return  # the first token already finished the request
            # The decoder pulls the prompt's KV; it encodes the images only if a
            # preemption makes it recompute the prompt.
            started_s = time.monotonic()
            job = Continue(attempt.engine_request(output_token_ids=first_tokens), handle)
            stream = self._stream(decode_id, job, placed_id, prefill=False, pulled_from=prefill_id)
            async with aclosing(stream) as s:
                async for delta in s:
                    completed = delta.finish_reason is not None
                    if completed:
                        decode_s = time.monotonic() - started_s
                        self._metrics.stage_s.labels("decode").observe(decode_s)
                    yield delta
        finally:
            self._router.release(placed_id, decode_id)
            prefill_client = self._clients(prefill_id)
            if not completed and prefill_client is not None:
                prefill_client.abort(request_id)  # frees the hold if nobody pulled it

    async def _stream(
        self,
        worker_id: str,
        job: Job,
        placed_id: str,
        *,
        prefill: bool,
        pulled_from: str | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """One worker's events as deltas; failures as exceptions; abort if cut short.
        The router's reservation of ``placed_id`` on this worker ends at its first event."""
        client = self._clients(worker_id)
        if client is None:
            raise WorkerDiedError(worker_id, "not in the registry")
        request = job.request
        started_s = time.monotonic()
        finished = False
        first = True
        events: AsyncIterator[WorkerEvent] | None = None
        try:
            events = client.generate(job)
            async for event in events:
                if first:
                    self._router.release(placed_id, worker_id)  # its telemetry counts it now
                match event:
                    case TokenDelta() as delta:
                        if prefill and first:
                            self._metrics.stage_s.labels("prefill").observe(
                                time.monotonic() - started_s
                            )
                        first = False
                        finished = delta.finish_reason is not None
                        yield delta
                    case ImagesPulled(num_bytes=num_bytes, duration_s=duration_s):
                        first = False
                        backend = self._kv_backend
                        self._metrics.transfer_bytes.labels(backend).inc(num_bytes)
                        self._metrics.transfer_s.labels(backend).observe(duration_s)
                    case KVPulled(num_bytes=num_bytes, duration_s=duration_s):
                        first = False
                        backend = self._kv_backend
                        self._metrics.transfer_bytes.labels(backend).inc(num_bytes)
                        self._metrics.transfer_s.labels(backend).observe(duration_s)
                        self._metrics.stage_s.labels("transfer").observe(duration_s)
                        if pulled_from is not None:
                            self._router.observe_transfer(
                                pulled_from, worker_id, num_bytes, duration_s
                            )
                    case RequestFailed(kind=FailureKind.INVALID, message=message, param=param):
                        finished = True
                        raise BadRequest(message, param)
                    case RequestFailed(kind=kind, message=message):
                        finished = True
                        if kind is FailureKind.TRANSFER:
                            self._metrics.transfer_failures.labels(self._kv_backend).inc()
                        log.warning("request %s on %s: %s", request.request_id, worker_id, message)
                        raise AttemptFailed(kind.value)
        finally:
            self._router.release(placed_id, worker_id)
            if not finished:
                client.abort(request.request_id)
            await _aclose(events)


def _generate(request: EngineRequest, embeddings: tuple[BlockHandle, ...]) -> Generate:
    """Generate, pulling first the embeddings of every encode part (none: encode here)."""
    if not embeddings:
        return Generate(request)
    return Generate(request, images=embeddings[0], more_images=embeddings[1:])


async def _all_or_none(coros: Iterable[Awaitable[_T]]) -> list[_T]:
    """Run ``coros`` at once; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _aclose(events: object) -> None:
    """Close a worker's event stream if it can be closed (fakes may give plain iterators)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
