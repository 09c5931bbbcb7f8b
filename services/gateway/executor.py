"""The plan executor: one request's journey through the workers, as one token stream.

    place          placement.py: router.place(profile, now) -> Plan | Hold | Reject
                   (held requests wait in the hold line, then a 429);
                   the plan stays reserved on a worker until that worker's first
                   event (its telemetry counts the request from then on)
    run            plan_runner.py: the plan on its workers (encode, colocated or
                   disaggregated), their streams as one
    re-plan        a worker died or a pull failed: place again; with tokens
                   already streamed, the prompt plus those tokens run on a live
                   worker and decoding continues, so the client sees one stream
    detokenize     here, over the whole stream, not on the workers: a worker that
                   continues someone else's request cannot know what text was held
                   back (an incomplete UTF-8 character, a possible stop string)

Every worker a request touched is told to abort it if the request does not end
normally (client hung up, error): its blocks, held ones included, are freed
(plan_runner.py). However the request ends, the router is told (``release``); when
it finishes, also what its first placement showed (``observe_outcome``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from router.correction import Outcome
from router.front_door import Router
from router.types import SLO, Plan, Priority, RequestProfile
from services.engine.block_hash import compute_block_hashes, image_hash_token_ids
from services.engine.messages import FinishReason, ImageInput, SamplingParams
from services.engine.tokenizer import Tokenizer
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import ServiceFailure
from services.gateway.placement import HoldSettings, Placer
from services.gateway.plan_runner import Attempt, AttemptFailed, PlanRunner
from services.metrics import BatonMetrics
from services.workers.client import WorkerClient, WorkerDiedError
from services.workers.messages import FailureKind, TokenDelta

__all__ = ["ExecutorConfig", "PlanExecutor"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    kv_backend: str
    hold: HoldSettings = field(default_factory=HoldSettings)  # waiting for room (placement.py)
    max_attempts: int = 3


@dataclass(slots=True)
class _Trace:
    """What the router predicted for a request's first placement, and what it saw."""

    plan: Plan | None = None
    placed_s: float = 0.0
    first_token_s: float | None = None
    # The first delta after the first token's, and the tokens counted with it: the gap
    # before it is the hand-off (a disaggregated plan's KV pull and adopt), which the
    # plan prices in its transfer, not in ``predicted_tpot_s`` (one decode step).
    decode_start_s: float | None = None
    decode_start_tokens: int = 0
    last_token_s: float = 0.0
    num_tokens: int = 0
    replaced: bool = False  # re-placed after a failure: its timings say nothing of the plan
    arrival_s: float = 0.0
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None

    def saw_tokens(self, now_s: float, num_tokens: int) -> None:
        """A delta with tokens arrived at ``now_s``; ``num_tokens`` generated so far."""
        if self.first_token_s is None:
            self.first_token_s = now_s
        elif self.decode_start_s is None:
            self.decode_start_s, self.decode_start_tokens = now_s, num_tokens
        self.last_token_s = now_s
        self.num_tokens = num_tokens

    def outcome(self) -> Outcome | None:
        plan = self.plan
        if plan is None or self.replaced or self.first_token_s is None:
            return None
        # TPOT as the plan predicts it: the decode steps after the hand-off. Measured
        # from the first token, a 2-token request's TPOT was its whole hand-off (0.5-1.1 s
        # on a loaded 2-core box against 1 ms predicted), which taught the correction a
        # 0.2 s TPOT bias and refused every later request on that decode worker.
        tpot_s = None
        if self.decode_start_s is not None and self.num_tokens > self.decode_start_tokens:
            steps = self.num_tokens - self.decode_start_tokens
            tpot_s = (self.last_token_s - self.decode_start_s) / steps
        # As the client sees it (what its SLO is judged by): the hand-off included.
        seen_tpot_s = None
        if self.num_tokens > 1:
            seen_tpot_s = (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)
        return Outcome(
            prefill_worker=plan.prefill_worker,
            decode_worker=plan.decode_worker or plan.prefill_worker,
            predicted_ttft_s=plan.predicted_ttft_s,
            observed_ttft_s=self.first_token_s - self.placed_s,
            predicted_tpot_s=plan.predicted_tpot_s,
            observed_tpot_s=tpot_s,
            at_s=self.last_token_s,
            met_ttft=_met(self.first_token_s - self.arrival_s, self.ttft_target_s),
            met_tpot=_met(seen_tpot_s, self.tpot_target_s),
        )


def _met(observed_s: float | None, target_s: float | None) -> bool | None:
    if observed_s is None or target_s is None:
        return None
    return observed_s <= target_s


class PlanExecutor:
    def __init__(
        self,
        router: Router,
        clients: Callable[[str], WorkerClient | None],
        metrics: BatonMetrics,
        config: ExecutorConfig,
        on_worker_died: Callable[[str], None],
        tokenizer: Tokenizer,
    ) -> None:
        self._tokenizer = tokenizer
        self._router = router
        self._metrics = metrics
        self._config = config
        self._on_worker_died = on_worker_died
        self._placer = Placer(
            router,
            clients,
            metrics,
            config.hold,
        )
        self._runner = PlanRunner(router, clients, metrics, config.kv_backend)

    def use_policy(self, name: str) -> None:
        """Place requests with the policy ``name`` from now on (placed ones are unaffected)."""
        self._router.use_policy(name)

    async def run(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        arrival_s: float,
        *,
        slo: SLO | None = None,
        priority: Priority = Priority.INTERACTIVE,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncGenerator[TokenDelta, None]:
        """Yield the request's deltas until one has ``finish_reason``; re-plan on failures."""
        num_image_tokens = sum(image.num_tokens for image in images)
        num_text_tokens = len(prompt_token_ids) - num_image_tokens
        profile = RequestProfile(
            request_id=request_id,
            num_prompt_tokens=num_text_tokens,  # the router adds the image tokens
            num_new_tokens=num_text_tokens,
            max_tokens=sampling.max_tokens,
            num_image_tokens=num_image_tokens,
            num_images=len(images),
            image_tokens=tuple(image.num_tokens for image in images),
            slo=slo or SLO(),
            # Prompt logprobs: the engine computes the whole prompt, cached or not.
            prefix_hashes=()
            if sampling.prompt_logprobs is not None
            else self._prefix_hashes(prompt_token_ids, images),
            priority=priority,
            arrival_s=arrival_s,
        )
        detokenizer = IncrementalDetokenizer(
            self._tokenizer,
            prompt_token_ids,
            stop=sampling.stop,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
        )
        generated: list[int] = []
        trace = _Trace()
        attempts = self._attempts(profile, prompt_token_ids, sampling, images, detokenizer, trace)
        try:
            async with aclosing(attempts):
                async for delta in attempts:
                    generated.extend(delta.token_ids)
                    if delta.token_ids:
                        trace.saw_tokens(time.monotonic(), len(generated))
                    if delta.finish_reason is not None:
                        self._observe_outcome(len(generated), trace)
                    yield delta
        finally:
            self._router.release(request_id)

    def _observe_outcome(self, num_generated: int, trace: _Trace) -> None:
        """The finished request teaches the router; ``/metrics`` shows where admission
        stands after it (a share under 1: admitted requests have been missing)."""
        self._router.observe_outcome(num_generated, trace.outcome())
        guard = self._router.admission.guard
        self._metrics.admission_share.labels("ttft").set(guard.ttft)
        self._metrics.admission_share.labels("tpot").set(guard.tpot)

    async def _attempts(
        self,
        profile: RequestProfile,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        images: tuple[ImageInput, ...],
        detokenizer: IncrementalDetokenizer,
        trace: _Trace,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Place and run the request, placing it again after a failure (at most
        ``max_attempts`` failures) or a decode worker without room (not a failure: as
        often as it takes); ends after the delta with ``finish_reason``."""
        request_id = profile.request_id
        generated: list[int] = []
        num_failures = 0  # failures of a worker or a pull; "no room" is not one
        attempt = 0
        while num_failures < self._config.max_attempts:
            attempt_id = request_id if attempt == 0 else f"{request_id}.retry{attempt}"
            placing = profile if attempt == 0 else _replaced(profile, len(generated))
            plan = await self._placer.place(placing, replaced=attempt > 0)
            if attempt == 0:
                trace.plan, trace.placed_s = plan, time.monotonic()
                trace.arrival_s = profile.arrival_s
                trace.ttft_target_s, trace.tpot_target_s = profile.slo.ttft_s, profile.slo.tpot_s
                self._metrics.stage_s.labels("queue").observe(trace.placed_s - profile.arrival_s)
            else:
                trace.replaced = True
            stream = self._runner.run(
                plan,
                Attempt(
                    request_id, attempt_id, prompt_token_ids, tuple(generated), sampling, images
                ),
            )
            try:
                async with aclosing(stream):  # closing aborts what is unfinished
                    async for delta in stream:
                        delta = _detokenize(detokenizer, delta, request_id)
                        generated.extend(delta.token_ids)
                        yield delta
                        if delta.finish_reason is not None:
                            return
                reason = "stream_ended"
            except WorkerDiedError as e:
                log.warning("request %s: %s; re-planning", request_id, e)
                self._on_worker_died(e.worker_id)
                reason = "worker_died"
            except AttemptFailed as e:
                reason = e.reason
            self._metrics.retries.labels(reason).inc()
            attempt += 1
            if reason != FailureKind.CAPACITY.value:
                num_failures += 1
                continue
            # No room on the decode worker is nobody's failure: the request is re-placed
            # (another worker, or this one as a whole request that waits in its queue)
            # however often it takes; the request's own deadline bounds it.
            await asyncio.sleep(self._config.hold.hold_poll_s)
        raise ServiceFailure(f"request failed on {self._config.max_attempts} placements; giving up")

    def _prefix_hashes(
        self, prompt: tuple[int, ...], images: tuple[ImageInput, ...]
    ) -> tuple[int, ...]:
        """The prompt's full blocks named as the workers name their cached blocks."""
        block_size = self._router.block_size()
        if block_size is None:
            return ()
        spans = [(i.offset, i.num_tokens, i.content_hash) for i in images]
        return tuple(compute_block_hashes(image_hash_token_ids(prompt, spans), block_size))


def _replaced(profile: RequestProfile, num_generated: int) -> RequestProfile:
    """The profile of a request placed again after a failure: it continues from its
    committed tokens (prompt + output so far are prefilled again) and is judged afresh,
    with no time-to-first-token target (its first token was sent long ago) and the
    arrival set to now, so no policy refuses it for its age."""
    num_tokens = profile.num_prompt_tokens + num_generated
    return replace(
        profile,
        num_prompt_tokens=num_tokens,
        num_new_tokens=num_tokens,
        max_tokens=max(1, profile.max_tokens - num_generated),
        slo=SLO(ttft_s=None, tpot_s=profile.slo.tpot_s),
        arrival_s=time.monotonic(),
        prefix_hashes=(),
    )


def _detokenize(
    detokenizer: IncrementalDetokenizer, delta: TokenDelta, request_id: str
) -> TokenDelta:
    """The delta with the gateway's text (workers send token ids only).

    A stop string seen here ends the request (the caller's stream closes, which aborts
    it on the worker); tokens after the one that completed the stop string are dropped
    and not counted, as if the engine had stopped there.
    """
    pieces: list[str] = []
    num_kept = len(delta.token_ids)
    for k, token_id in enumerate(delta.token_ids):
        text, stopped = detokenizer.add(token_id)
        pieces.append(text)
        if stopped:
            num_kept = k + 1
            break
    finish = delta.finish_reason
    if detokenizer.stopped:
        finish = FinishReason.STOP
    elif finish is not None:
        pieces.append(detokenizer.finish())  # flush what was held back for a stop string
    num_dropped = len(delta.token_ids) - num_kept
    return replace(
        delta,
        request_id=request_id,
        text="".join(pieces),
        finish_reason=finish,
        token_ids=delta.token_ids[:num_kept],
        num_output_tokens=delta.num_output_tokens - num_dropped,
        logprobs=delta.logprobs[:num_kept] if delta.logprobs is not None else None,
    )
