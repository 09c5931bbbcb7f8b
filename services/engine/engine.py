"""LLMEngine: the embedded engine behind the ``Engine`` protocol (services/backends/protocol.py).

One step: schedule -> build the flat batch -> model forward (writes KV into the
paged pool) -> logits of each sequence that caught up -> sample -> append,
check stops on token ids -> free or hold finished requests -> output deltas.
Not thread-safe: one worker thread owns it.

Tokens only: text has one owner, the gateway, which detokenizes and checks stop
strings and aborts the request when one matches (as vLLM's front end does with
its engine core). The engine stops on EOS, stop token ids, length and grammars.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.types import KVLayout
from services.backends.protocol import AdmissionFeedback, AdmissionPolicy
from services.config import EngineConfig
from services.engine.block_hash import image_hash_token_ids
from services.engine.cpu_kernels import TORCH_KERNELS, select_cpu_kernels
from services.engine.grammar import GrammarCompiler, apply_grammar_masks
from services.engine.kv_cache import BlockManager, allocate_kv_pool
from services.engine.linear import can_pack, pack_linears
from services.engine.loader import LoadedModel
from services.engine.messages import (
    EngineRequest,
    EngineStats,
    FinishReason,
    HeldKV,
    ImageInput,
    InvalidRequestError,
    NoRoomError,
    RequestOutput,
    StepStats,
    TokenLogprob,
)
from services.engine.multimodal import EncoderCache, ImageResolver, image_embeds_for_step
from services.engine.prompt_logprobs import add_prompt_logprobs, prompt_spans
from services.engine.request import Request, RequestStatus
from services.engine.sampler import Sampler
from services.engine.scheduler import ScheduledRequest, Scheduler
from services.engine.step_inputs import StepInputs, build_step_inputs
from services.engine.validation import validate_request

__all__ = ["EngineModelInfo", "LLMEngine"]

_NUM_RECENT_STEPS = 64
_NUM_RECENT_OUTPUTS = 200
_PREFIX_DIGEST_BLOCKS = 4096  # most recently cached block hashes in the telemetry digest
_ENCODER_CACHE_ENTRIES = 256  # images whose embeddings are kept (multimodal models)


@dataclass(frozen=True, slots=True)
class EngineModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class LLMEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        *,
        seed: int = 0,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        self.model = loaded.model
        if config.packed_linears and can_pack(self.model):  # oneDNN-packed weights (linear.py)
            pack_linears(self.model, batch_size_hint=min(config.max_num_seqs, 32))
        self._kernels = select_cpu_kernels(loaded.device, enabled=config.cpu_kernels)
        self.model.cpu_kernels = self._kernels
        self.tokenizer = loaded.tokenizer
        self.config = config
        args = loaded.args
        self._layout = KVLayout(
            num_layers=args.num_layers,
            block_size=config.block_size,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=str(loaded.device),
        )
        num_blocks = config.kv_cache_bytes // self._layout.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {self._layout.block_bytes} bytes"
            )
        self.kv = allocate_kv_pool(self._layout, num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            admission=admission,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
        # A request longer than the whole pool could never run; the limit says so up front.
        max_model_len = min(
            config.max_model_len or args.max_position_embeddings,
            args.max_position_embeddings,
            num_blocks * config.block_size,
        )
        eos = tuple(loaded.tokenizer.eos_token_ids) or args.eos_token_ids
        self._info = EngineModelInfo(loaded.name, max_model_len, args.vocab_size, eos)
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(loaded.tokenizer, args.vocab_size, eos)
        self.generator = torch.Generator(device=loaded.device).manual_seed(seed)
        self.images = ImageResolver(loaded.vision, EncoderCache(_ENCODER_CACHE_ENTRIES))
        self._requests: dict[str, Request] = {}
        self._adopting: dict[str, Request] = {}
        self._recent_steps: deque[StepStats] = deque(maxlen=_NUM_RECENT_STEPS)
        self._recent_output_lens: deque[int] = deque(maxlen=_NUM_RECENT_OUTPUTS)
        self._num_prompt_tokens_computed = 0

    # -- Engine protocol: properties -------------------------------------------
    @property
    def model_info(self) -> EngineModelInfo:
        return self._info

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def kv_storage(self) -> torch.Tensor:
        return self.kv

    # -- requests in ------------------------------------------------------------
    def prepare(self, request: EngineRequest) -> None:
        """Thread-safe, called off the engine loop before ``add_request``: compile the
        request's grammar into the cache (a 400 naming the field if it cannot be)."""
        if request.sampling.structured is not None:
            self.grammars.compile(request.sampling.structured)

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add(self._admit(request, resolve_images=True))

    def adopt(self, request: EngineRequest) -> list[int]:
        """Allocate blocks for the prompt's KV, to be filled by a pull; see the protocol."""
        if not request.output_token_ids:
            raise InvalidRequestError(
                "an adopted request carries its first token", "output_token_ids"
            )
        num_blocks = self.block_manager.blocks_needed(len(request.prompt_token_ids))
        if num_blocks > self.block_manager.num_free_blocks:
            raise NoRoomError(
                f"no room to adopt: {num_blocks} blocks needed, "
                f"{self.block_manager.num_free_blocks} free"
            )
        r = self._admit(request)
        r.status = RequestStatus.ADOPTING
        self._adopting[r.request_id] = r
        return self.block_manager.allocate_exact(r.request_id, len(r.prompt_token_ids))

    def start_adopted(self, request_id: str) -> None:
        r = self._adopting.pop(request_id, None)
        if r is None:
            raise InvalidRequestError(f"no adopted request {request_id!r}", "request_id")
        r.num_computed_tokens = r.num_prompt_tokens
        self.scheduler.add_adopted(r)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)  # frees running and held blocks
        if self._adopting.pop(request_id, None) is not None:
            self.block_manager.free(request_id)
        self._requests.pop(request_id, None)

    def release_held(self, request_id: str) -> None:
        self.block_manager.release_held(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start_s = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        inputs = build_step_inputs(plan.scheduled, self.block_manager)
        spans = prompt_spans(plan.scheduled)  # before the step advances the requests
        hidden = self.model.forward(
            inputs.batch, self.kv, self._inputs_embeds(plan.scheduled, inputs)
        )
        if spans:
            add_prompt_logprobs(hidden, spans, self.model.compute_logits)
        self._advance(plan.scheduled)
        token_ids, logprobs = self._sample(hidden, inputs)
        outputs = [
            self._append_token(r, token_id, lp)
            for r, token_id, lp in zip(inputs.sample_requests, token_ids, logprobs)
        ]
        self._record_step(inputs, time.perf_counter() - start_s, time.monotonic())
        return outputs

    def _inputs_embeds(
        self, scheduled: Sequence[ScheduledRequest], inputs: StepInputs
    ) -> torch.Tensor | None:
        """The step's input embeddings with images placed; None when no image is in it."""
        for item in scheduled:
            r = item.request
            # An adopted request recomputing its prompt after a preemption: encode now.
            if r.images and not r.image_embeds and r.num_computed_tokens < r.num_prompt_tokens:
                r.image_embeds = self.images.resolve(r.images)
        pieces = image_embeds_for_step(scheduled)
        if not pieces:
            return None
        embeds = self.model.embed(inputs.batch.input_ids)
        for row, image_rows in pieces:
            embeds[row : row + image_rows.shape[0]] = image_rows
        return embeds

    def _advance(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """The scheduled tokens' KV is now in the pool: count it, name full blocks for reuse."""
        for item in scheduled:
            r = item.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                self._num_prompt_tokens_computed += (
                    min(r.num_computed_tokens + item.num_new_tokens, r.num_prompt_tokens)
                    - r.num_computed_tokens
                )
            r.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(
                r.request_id, r.hash_token_ids, r.num_computed_tokens
            )

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        if not inputs.sample_requests:
            return [], []
        if len(inputs.sample_rows) < hidden.shape[0]:
            rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=hidden.device)
            hidden = hidden.index_select(0, rows)
        # else every row samples (rows ascend, so they are 0..T-1 in order): a pure decode step.
        logits = self.model.compute_logits(hidden)
        logits = apply_grammar_masks(
            logits, [r.grammar for r in inputs.sample_requests], self._info.vocab_size
        )
        result = self.sampler.sample(
            logits,
            [r.sampling for r in inputs.sample_requests],
            [r.output_token_ids for r in inputs.sample_requests],
            self._info.eos_token_ids,
            self.generator,
            [r.distinct_prompt_ids() for r in inputs.sample_requests],
        )
        logprobs = result.logprobs or [None] * len(result.token_ids)
        return list(result.token_ids), list(logprobs)

    def _append_token(self, r: Request, token_id: int, lp: TokenLogprob | None) -> RequestOutput:
        r.append_output(token_id)
        grammar_done = r.grammar is not None and _grammar_ends(r.grammar, token_id)
        reason = FinishReason.STOP if grammar_done else self._finish_reason(r, token_id)
        held = self._finish(r, reason) if reason is not None else None
        prompt_logprobs = None
        if r.prompt_logprobs is not None:  # its first output: they go with it, once
            prompt_logprobs, r.prompt_logprobs = tuple(r.prompt_logprobs), None
        return RequestOutput(
            request_id=r.request_id,
            new_token_ids=(token_id,),
            finish_reason=reason,
            logprobs=(lp,) if lp is not None and r.sampling.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens,
            held_kv=held,
        )

    def _finish_reason(self, r: Request, token_id: int) -> FinishReason | None:
        sp = r.sampling
        if r.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self._info.eos_token_ids:
                return FinishReason.STOP
            if token_id in sp.stop_token_ids:
                return FinishReason.STOP
        if r.num_output_tokens >= sp.max_tokens or r.num_tokens >= self._info.max_model_len:
            return FinishReason.LENGTH
        if r.prefill_only:
            return FinishReason.PREFILLED
        return None

    def _finish(self, r: Request, reason: FinishReason) -> HeldKV | None:
        r.finish_reason = reason
        self._requests.pop(r.request_id, None)
        if reason is FinishReason.PREFILLED:
            block_ids = self.scheduler.finish(r, hold=True)
            return HeldKV(tuple(block_ids), r.num_prompt_tokens, self._layout)
        self.scheduler.finish(r)
        self._recent_output_lens.append(r.num_output_tokens)
        if isinstance(self.scheduler.admission, AdmissionFeedback):
            self.scheduler.admission.observe_finished(r.num_output_tokens)
        return None

    def _record_step(self, inputs: StepInputs, duration_s: float, end_s: float) -> None:
        self._recent_steps.append(
            StepStats(
                duration_s=duration_s,
                num_prefill_tokens=inputs.num_prefill_tokens,
                num_decode_seqs=inputs.num_decode_seqs,
                total_context_tokens=sum(inputs.batch.context_lens),
                end_s=end_s,
            )
        )

    # -- validation (the message's own checks: validation.py) ---------------------
    def _admit(self, message: EngineRequest, *, resolve_images: bool = False) -> Request:
        """Validate a request (InvalidRequestError names the field) and start tracking it.

        ``resolve_images``: the request computes its prompt here, so its images'
        embeddings are needed (given, cached or encoded now); an adopted one's KV
        arrives from elsewhere and its images only name its blocks.
        """
        if message.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {message.request_id!r}", "request_id")
        validate_request(message, self._info.vocab_size, self._info.max_model_len)
        prompt = message.prompt_token_ids
        self.images.validate(prompt, message.images)
        r = Request.from_message(message)
        if message.images:
            r.images = message.images
            r.hash_token_ids = [
                *image_hash_token_ids(prompt, _image_spans(message.images)),
                *message.output_token_ids,
            ]
            if resolve_images:
                r.image_embeds = self.images.resolve(message.images)
        if r.sampling.structured is not None:
            # Replaying the committed outputs puts the matcher where the last worker left it.
            r.grammar = self.grammars.matcher(r.sampling.structured, r.output_token_ids)
        self._requests[r.request_id] = r
        return r

    # -- introspection ----------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        waiting = self.scheduler.prompt_tokens_to_compute()
        return EngineStats(
            block_size=bm.block_size,
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_held_blocks=bm.num_held_blocks,
            running=self.scheduler.running_stats(),
            waiting_prompt_lens=tuple(n for _, n in waiting),
            waiting_request_ids=tuple(rid for rid, _ in waiting),
            recent_steps=tuple(self._recent_steps),
            recent_output_lens=tuple(self._recent_output_lens),
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            cached_block_hashes=bm.cached_hashes(_PREFIX_DIGEST_BLOCKS),
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            long_prefill_token_threshold=self.scheduler.long_prefill_token_threshold,
            num_images_encoded=self.images.num_images_encoded,
            num_image_cache_hits=self.images.num_cache_hits,
            kernels=TORCH_KERNELS if self._kernels is None else self._kernels.name,
        )

    # -- optional capability: the encode role (services/workers/images.py) ------
    @property
    def image_embedding_shape(self) -> tuple[int, int] | None:
        """``(tokens per image, hidden)`` of this model's image embeddings; None: no images."""
        vision = self.images.vision
        if vision is None:
            return None
        return vision.num_image_tokens, vision.encoder.multi_modal_projector.linear_2.out_features

    def encode_images(self, images: Sequence[ImageInput]) -> torch.Tensor:
        """``[N, tokens per image, hidden]``: the images' embeddings, from the
        encoder-output cache or encoded now (counted in ``stats``)."""
        return torch.stack([embeds for _, embeds in self.images.resolve(images)])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)


def _grammar_ends(matcher: Any, token_id: int) -> bool:
    """Advance the request's grammar; True once it is complete (or cannot go on)."""
    # The mask only lets allowed tokens through, so a refusal means every token was masked.
    return not matcher.accept_token(token_id) or bool(matcher.is_terminated())


def _image_spans(images: Sequence[ImageInput]) -> list[tuple[int, int, str]]:
    return [(i.offset, i.num_tokens, i.content_hash) for i in images]
