"""Baton's Engine protocol over vLLM's v1 engine, run in this process.

One ``vllm.v1.engine.llm_engine.LLMEngine`` with its engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``step()`` schedules, runs the model and
samples synchronously, on the worker's engine-loop thread, like the embedded engine.

Disaggregation uses vLLM's own ``NixlConnector`` (``moves_own_kv``): Baton's
kvtransfer layer is not involved.

* Prefill-only: the request goes in with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True, ...}``; when it finishes, vLLM
  returns the parameters a decoder needs (engine id, block ids, side-channel
  address), which leave as ``RequestOutput.remote_kv`` and travel opaquely in the
  ``BlockHandle``.
* Decode: the request goes in again with those parameters; vLLM's scheduler
  waits for the connector to pull the prompt's KV, recomputes the last prompt
  token and samples the first output token itself. That token was already
  streamed from the prefill worker, so it is dropped here (greedy and seeded
  sampling give it again: same logits, the same first draw of the request's
  generator).
* Held prefill blocks are freed by vLLM when the decoder's pull completes, when
  an aborted decoder sends its rejection notification, or, if no decoder ever
  comes (the client hung up between prefill and decode), when the lease
  (``kvtransfer.lease_s``, vLLM's ``kv_lease_duration``) runs out.

A request that continues after a failure (``output_token_ids`` set) is sent as
prompt + output so far, with the budget reduced by what was generated: greedy
text is unchanged.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtransfer.types import KVLayout
from services.backends.vllm.images import vllm_image_prompt
from services.backends.vllm.params import (
    prompt_token_logprobs,
    refused_field,
    remote_decode_params,
    sampling_params,
    token_logprobs,
)
from services.backends.vllm.steps import images_to_encode, step_stats
from services.engine.messages import (
    EngineError,
    EngineRequest,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    RunningRequestStats,
    StepStats,
)

__all__ = ["VllmEngine"]


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ``ValueError`` and its client errors
    (``VLLMValidationError``: a token id out of its vocabulary). Let through, one escaped
    ``add_request`` into the worker loop, which fails every request in flight there.
    Imported here, not at the top: by the time a request is refused, the engine has
    loaded vLLM (importing it costs seconds)."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, VLLMClientError)


log = logging.getLogger(__name__)

_RECENT_STEPS = 64
_RECENT_OUTPUT_LENS = 256
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True, slots=True)
class _ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True)
class _Tracked:
    """Baton's bookkeeping of one request inside vLLM."""

    request: EngineRequest
    internal_id: str  # vLLM's id for it (the request id plus a suffix vLLM adds)
    num_prior_outputs: int  # output tokens generated before this engine saw the request
    drop_first: bool  # a decode continuation: vLLM regenerates the token already streamed
    num_generated: int = 0  # tokens delivered from this engine
    # (prompt position, image tokens) of each image vLLM encodes here: files (not encode
    # workers' embeddings) of a request that computes its prompt here (not a
    # continuation, whose KV is pulled). vLLM encodes an image in the step whose chunk
    # reaches its first placeholder.
    encodes: tuple[tuple[int, int], ...] = ()
    sent_prompt_logprobs: bool = False  # sent with the first output (vLLM sends them once)
    counted_hits: bool = False  # its prefix-cache hits added to the engine's count


class VllmEngine:
    """The Engine protocol over ``vllm.v1.engine.llm_engine.LLMEngine``."""

    # The worker loop hands KV movement to the engine (vLLM's connector), not kvtransfer.
    moves_own_kv = True
    # Tokens only, as every engine: the gateway detokenizes and checks stop strings
    # (one owner for text), so vLLM is asked for no text and no stop-string matching.

    def __init__(
        self, llm: Any, name: str, image_embedding_shape: tuple[int, int] | None = None
    ) -> None:
        self._llm = llm
        # LLaVA: (tokens per image, hidden); the worker lands encode workers' embeddings
        # in a pool of this shape and vLLM takes them as precomputed image embeddings.
        self.image_embedding_shape = image_embedding_shape
        model_config = llm.vllm_config.model_config
        cache = llm.vllm_config.cache_config
        tokenizer = llm.get_tokenizer()
        eos = tokenizer.eos_token_id
        self._info = _ModelInfo(
            name=name,
            max_model_len=int(model_config.max_model_len),
            vocab_size=int(model_config.get_vocab_size()),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
        self._layout = KVLayout(
            num_layers=int(model_config.get_num_layers(llm.vllm_config.parallel_config)),
            block_size=int(cache.block_size),
            num_kv_heads=int(model_config.get_total_num_kv_heads()),
            head_dim=int(model_config.get_head_size()),
            dtype=str(model_config.dtype).removeprefix("torch."),
            device="cpu" if llm.vllm_config.device_config.device_type == "cpu" else "cuda",
        )
        self._tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}
        # A finished prefill-only request -> (vLLM's id for it, blocks it holds)
        self._held: dict[str, tuple[str, int]] = {}
        self._recent_steps: deque[StepStats] = deque(maxlen=_RECENT_STEPS)
        self._recent_output_lens: deque[int] = deque(maxlen=_RECENT_OUTPUT_LENS)
        self._num_prompt_tokens_computed = 0
        self._num_prefix_hit_tokens = 0  # of the prompts computed here (not pulled ones)

    # -- the scheduler we read telemetry from ------------------------------------------
    @property
    def _scheduler(self) -> Any:
        return self._llm.engine_core.engine_core.scheduler

    # -- Engine protocol -----------------------------------------------------------------
    @property
    def model_info(self) -> _ModelInfo:
        return self._info

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def kv_storage(self) -> Any:
        """None: vLLM moves its own KV; there is no pool for a kvtransfer connector."""
        return None

    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request``; with ``request.remote_kv`` (a prefill worker's handle
        payload) it continues a request whose prompt KV vLLM's connector pulls."""
        request.sampling.validate()
        remote_kv = request.remote_kv
        prior = request.output_token_ids
        if remote_kv is not None and not prior:
            raise InvalidRequestError("a continuation needs the token the prefill produced")
        # A continuation leaves its last token out: vLLM samples it again from the pulled KV.
        drop_first = remote_kv is not None
        known = prior[:-1] if drop_first else prior
        tokens = [*request.prompt_token_ids, *known]
        if not request.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(tokens) >= self._info.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({len(tokens)} tokens) leaves no room to generate within the "
                f"model's context length ({self._info.max_model_len})",
                "prompt",
            )
        if request.sampling.top_k > self._info.vocab_size:
            raise InvalidRequestError(
                f"top_k must be at most the vocabulary size ({self._info.vocab_size})", "top_k"
            )
        if request.request_id in self._tracked:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        params = sampling_params(
            request.sampling,
            len(known),
            len(tokens),
            request.prefill_only,
            self._info.max_model_len,
            continued=bool(prior),
        )
        if request.prefill_only:
            params.extra_args = {"kv_transfer_params": remote_decode_params()}
        elif remote_kv is not None:
            params.extra_args = {"kv_transfer_params": dict(remote_kv)}
        prompt: dict[str, Any] = {"prompt_token_ids": tokens}
        if request.images:
            # Files (vLLM encodes them here) or encode workers' embeddings; vLLM expands
            # the placeholders. A continuation carries the files too, so its prefix-cache
            # hashes cover the images and a failed pull that recomputes the prompt
            # encodes them again.
            folded, images = vllm_image_prompt(request.prompt_token_ids, request.images)
            prompt = {"prompt_token_ids": [*folded, *known], "multi_modal_data": {"image": images}}
        try:
            internal_id = self._llm.add_request(request.request_id, prompt, params)
        except _client_errors() as e:  # vLLM's own validation (evaluated only on an error)
            raise InvalidRequestError(str(e), refused_field(e, request.sampling)) from e
        files = remote_kv is None and any(i.embeddings is None for i in request.images)
        encodes = tuple((i.offset, i.num_tokens) for i in request.images) if files else ()
        tracked = _Tracked(request, str(internal_id), len(known), drop_first, encodes=encodes)
        self._tracked[request.request_id] = tracked

    def step(self) -> list[RequestOutput]:
        scheduler = self._scheduler
        before = {r.request_id: r.num_computed_tokens for r in scheduler.running}
        prompt_lens = {r.request_id: r.num_prompt_tokens for r in scheduler.running}
        for r in scheduler.waiting:
            before.setdefault(r.request_id, r.num_computed_tokens)
            prompt_lens.setdefault(r.request_id, r.num_prompt_tokens)
        started = time.monotonic()
        outputs = self._llm.step()
        ended = time.monotonic()
        encodes = {vid: t.encodes for vid, t in self._by_vllm_id().items() if t.encodes}
        # The step's requests as they are now: a prefill for a decoder elsewhere finished
        # in it and left the running queue (vLLM keeps it, its KV held, until pulled).
        known = scheduler.requests
        stepped = [known[vid] for vid in before if vid in known]
        step = step_stats(stepped, before, prompt_lens, encodes, ended - started, ended)
        if step is not None:
            self._num_prompt_tokens_computed += step.num_prefill_tokens
            self._recent_steps.append(step)
        results: list[RequestOutput] = []
        for out in outputs:
            converted = self._convert(out)
            if converted is not None:
                results.append(converted)
        self._forget_released()
        return results

    def _by_vllm_id(self) -> dict[str, _Tracked]:
        """The tracked requests by vLLM's id for them (its scheduler's ``request_id``:
        ours plus a suffix)."""
        return {t.internal_id: t for t in self._tracked.values()}

    def _convert(self, out: Any) -> RequestOutput | None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None or not out.outputs:
            return None
        completion = out.outputs[0]
        if not tracked.counted_hits and not tracked.drop_first:
            tracked.counted_hits = True  # vLLM's count for the request, from its first output
            self._num_prefix_hit_tokens += int(out.num_cached_tokens or 0)
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = token_logprobs(completion.logprobs, token_ids) if completion.logprobs else None
        if tracked.drop_first and tracked.num_generated == 0 and token_ids:
            streamed = tracked.request.output_token_ids[-1]
            if token_ids[0] != streamed:
                log.warning(
                    "request %s: the decoder sampled %d where the prefill worker streamed %d",
                    out.request_id,
                    token_ids[0],
                    streamed,
                )
            tracked.num_generated = 1  # the token the prefill worker streamed already
            token_ids = token_ids[1:]
            logprobs = logprobs[1:] if logprobs is not None else None
        tracked.num_generated += len(token_ids)
        finish = _FINISH.get(completion.finish_reason) if out.finished else None
        if out.finished and finish is None:
            finish = FinishReason.STOP
        remote_kv = None
        request = tracked.request
        if out.finished and request.prefill_only and out.kv_transfer_params:
            finish = FinishReason.PREFILLED
            remote_kv = dict(out.kv_transfer_params)
            num_blocks = math.ceil(
                (len(request.prompt_token_ids) + tracked.num_prior_outputs)
                / self._layout.block_size
            )
            self._held[request.request_id] = (tracked.internal_id, num_blocks)
        prompt_logprobs = None
        if out.prompt_logprobs and not tracked.sent_prompt_logprobs:
            tracked.sent_prompt_logprobs = True  # asked for only where nothing came before
            prompt_logprobs = prompt_token_logprobs(out.prompt_logprobs, request.prompt_token_ids)
        if out.finished:
            del self._tracked[request.request_id]
            if finish is not FinishReason.PREFILLED:
                self._recent_output_lens.append(tracked.num_prior_outputs + tracked.num_generated)
        if not token_ids and finish is None and prompt_logprobs is None:
            return None
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            finish_reason=finish,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=tracked.num_prior_outputs + tracked.num_generated,
            num_cached_tokens=int(out.num_cached_tokens or 0),
            remote_kv=remote_kv,
        )

    def _forget_released(self) -> None:
        """Prefill holds that vLLM has let go (pulled, rejected or expired)."""
        if not self._held:
            return
        alive = self._scheduler.requests
        for request_id, (internal_id, _) in list(self._held.items()):
            if internal_id not in alive:
                del self._held[request_id]

    def abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is not None:
            self._llm.abort_request([request_id])
        # A finished prefill's hold is vLLM's to free: on the decoder's pull or
        # rejection notification, else when its lease runs out.

    def has_unfinished(self) -> bool:
        return bool(self._llm.has_unfinished_requests())

    def holds_blocks(self) -> bool:
        """Finished prefills still hold blocks for a decoder. vLLM expires their
        leases only while it is stepped, so the worker loop keeps stepping."""
        self._forget_released()
        return bool(self._held)

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        self._forget_released()
        pool = scheduler.kv_cache_manager.block_pool
        total = int(pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block
        ours = self._by_vllm_id()
        # A continuation's outputs before this engine (vLLM counts from its prompt, which
        # holds them).
        prior = {vid: t.num_prior_outputs for vid, t in ours.items()}
        encoding = {vid: t.encodes for vid, t in ours.items() if t.encodes}
        # Requests whose prompt is not all computed, in the order vLLM takes them.
        prompting = [
            r
            for r in (*scheduler.running, *scheduler.waiting)
            if r.num_computed_tokens < r.num_prompt_tokens
        ]
        running = tuple(
            RunningRequestStats(
                request_id=r.request_id,
                num_tokens_held=int(r.num_computed_tokens),
                num_generated=int(r.num_output_tokens) + prior.get(r.request_id, 0),
                max_tokens=int(r.max_tokens) + prior.get(r.request_id, 0),
            )
            for r in scheduler.running
        )
        free = int(pool.get_num_free_blocks())
        return EngineStats(
            block_size=self._layout.block_size,
            num_total_blocks=total,
            num_free_blocks=free,
            num_cached_blocks=0,  # vLLM's free queue would be walked to tell: not counted
            # Each held prompt's blocks, at most the blocks in use: prompts held at once
            # share their cached prefix's blocks, which the sum counts once per prompt.
            num_held_blocks=min(sum(n for _, n in self._held.values()), total - free),
            running=running,
            waiting_prompt_lens=tuple(
                int(r.num_prompt_tokens - r.num_computed_tokens) for r in prompting
            ),
            waiting_request_ids=tuple(
                ours[r.request_id].request.request_id if r.request_id in ours else r.request_id
                for r in prompting
            ),
            waiting_image_tokens=images_to_encode(prompting, encoding),
            recent_steps=tuple(self._recent_steps),
            recent_output_lens=tuple(self._recent_output_lens),
            num_preemptions=sum(int(r.num_preemptions) for r in scheduler.requests.values()),
            num_prefix_hit_tokens=self._num_prefix_hit_tokens,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            max_num_batched_tokens=int(scheduler.max_num_scheduled_tokens),
            long_prefill_token_threshold=int(
                scheduler.scheduler_config.long_prefill_token_threshold or 0
            ),
        )

    def release_held(self, request_id: str) -> None:
        """vLLM frees held prefill blocks itself (pull, rejection or lease)."""

    def adopt(self, request: EngineRequest) -> list[int]:
        raise EngineError("the vllm backend continues requests with add_request(remote_kv=...)")

    def start_adopted(self, request_id: str) -> None:
        raise EngineError("the vllm backend continues requests with add_request(remote_kv=...)")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(token_ids))
        return text
