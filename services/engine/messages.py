"""Messages in and out of an engine. Frozen and slotted: they cross process boundaries."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvtransfer.types import KVLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "HeldKV",
    "ImageInput",
    "InvalidRequestError",
    "ModelLoadError",
    "NoRoomError",
    "RequestOutput",
    "RunningRequestStats",
    "SamplingParams",
    "StepStats",
    "StructuredOutput",
    "TokenLogprob",
    "UnsupportedModelError",
]


class EngineError(Exception):
    """Base class of engine errors.

    EngineError
     ├── InvalidRequestError     bad request (too long, max_tokens <= 0, ...): HTTP 400
     ├── NoRoomError             no KV room to adopt now: the gateway re-places it
     ├── ModelLoadError          folder missing weights/config, unreadable files
     │    └── UnsupportedModelError   architecture we do not implement
    """


class InvalidRequestError(EngineError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoRoomError(EngineError):
    """No KV room for this request now (adopt): not the request's fault; place it elsewhere."""


class ModelLoadError(EngineError):
    pass


class UnsupportedModelError(ModelLoadError):
    pass


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token id, a grammar's end; a stop string (at the gateway)
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    PREFILLED = "prefilled"  # a prefill-only request stopped after its first token


# Bounds checked at the door (the gateway calls ``validate``) and again by the engine.
MAX_GRAMMAR_SPEC_BYTES = 64 * 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_REPETITION_PENALTY = 100.0
StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output, backend-neutral (vLLM's ``StructuredOutputsParams`` maps 1:1).

    ``spec`` by kind: ``json`` a JSON schema (JSON text), ``json_object`` empty, ``regex``
    a regular expression, ``choice`` a JSON list of strings, ``grammar`` EBNF,
    ``structural_tag`` xgrammar's structural-tag JSON. ``param`` is the request field it
    came from, named in errors (``response_format`` or ``structured_outputs``).
    """

    kind: StructuredKind
    spec: str = ""
    any_whitespace: bool = False  # compact JSON unless asked: a weak model must not wander
    param: str = "structured_outputs"

    def validate(self) -> None:
        if len(self.spec.encode()) > MAX_GRAMMAR_SPEC_BYTES:
            raise InvalidRequestError(
                f"the {self.kind} constraint is over {MAX_GRAMMAR_SPEC_BYTES} bytes", self.param
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: a token in the prompt or the output so far has its logit divided by it
    # (multiplied where negative); 1 is off.
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: chosen token plus k alternatives
    # The prompt's own tokens, each given the ones before it (vLLM's ``prompt_logprobs``):
    # None: none; k >= 0: the prompt token plus k alternatives, sent with the first token.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(
                f"temperature must be in [0, 2], got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(
                    f"{name} must be in [-2, 2], got {getattr(self, name)}", name
                )
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # vLLM's sampler takes a 64-bit seed: a larger one failed its whole step.
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed}", "seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(
                f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(
                f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
                "prompt_logprobs",
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias has over {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
            )
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100], got "
                    f"{token_id}: {bias}",
                    "logit_bias",
                )
        if self.structured is not None:
            self.structured.validate()


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a request: where its placeholders sit, and its data or its embeddings.

    ``offset`` is the prompt position of its first placeholder token and ``num_tokens``
    the run's length. ``content_hash`` names the image's bytes (hex): the encoder-output
    cache and the prefix cache key on it. With ``data`` (the encoded file: PNG, JPEG,
    WebP) the engine encodes the image; with ``embeddings`` (``[num_tokens, hidden]``,
    from an encode worker) it places them as they are. A request whose KV arrives from
    elsewhere (adopt) may carry neither: it only needs the hash.
    """

    content_hash: str
    offset: int
    num_tokens: int
    data: bytes | None = None
    embeddings: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request as the engine sees it.

    ``output_token_ids`` is non-empty only for a request that continues elsewhere
    (adopted after a remote prefill, or re-planned after a worker died): those
    tokens were already generated and streamed, and count toward ``max_tokens``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    prefill_only: bool = False
    output_token_ids: tuple[int, ...] = ()
    arrival_time_s: float = 0.0
    # Engines that move their own KV (``moves_own_kv``, vLLM): the prefill worker's
    # transfer parameters; the engine pulls the prompt's KV itself and continues.
    remote_kv: Mapping[str, Any] | None = None
    images: tuple[ImageInput, ...] = ()  # in prompt order


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class HeldKV:
    """Blocks a prefill-only request keeps after finishing, ready to be pulled."""

    block_ids: tuple[int, ...]
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    layout: KVLayout


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, not a total).

    Token ids only: the gateway owns text (detokenizing, stop strings).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    # With ``prompt_logprobs`` asked for, on the request's first output from the engine
    # that computed its prompt: prompt tokens 1..P-1, each given those before it.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including adopted ones
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    held_kv: HeldKV | None = None  # set when a prefill-only request finishes
    # Instead of held_kv, from an engine that moves its own KV: what a decoder's
    # engine needs to pull it (vLLM's kv_transfer_params), opaque to Baton.
    remote_kv: Mapping[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RunningRequestStats:
    request_id: str
    num_tokens_held: int  # c_i: KV tokens held
    num_generated: int  # g_i
    max_tokens: int  # M_i


@dataclass(frozen=True, slots=True)
class StepStats:
    duration_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    total_context_tokens: int
    end_s: float = 0.0  # when the step ended: the engine process's time.monotonic()
    # Encodes inside the step (``router.types.StepSample``): requests, image tokens.
    num_encodes: int = 0
    num_encoded_image_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    block_size: int
    num_total_blocks: int
    num_free_blocks: int  # allocatable now, cached-but-unreferenced included
    num_cached_blocks: int  # unreferenced blocks kept for prefix reuse
    num_held_blocks: int  # kept for a remote puller (prefill-only requests)
    running: tuple[RunningRequestStats, ...]
    # Each prompt's tokens still to compute before its first token, in the order the
    # scheduler takes them: running prompts part-way through their chunks, then the queue.
    waiting_prompt_lens: tuple[int, ...]
    recent_steps: tuple[StepStats, ...]
    recent_output_lens: tuple[int, ...]  # output lengths of recently finished requests
    num_preemptions: int
    num_prefix_hit_tokens: int  # cumulative
    num_prompt_tokens_computed: int  # cumulative
    # Chained hashes (services/engine/block_hash.py) of cached full blocks, the most
    # recently cached last: the router's prefix digest of this engine.
    cached_block_hashes: tuple[int, ...] = ()
    max_num_batched_tokens: int = 0  # the step's token budget; 0: unknown
    long_prefill_token_threshold: int = 0  # with others waiting, a request's most a step
    num_images_encoded: int = 0  # cumulative: images this engine ran its encoder on
    num_image_cache_hits: int = 0  # cumulative: images served from the encoder-output cache
    kernels: str = ""  # the model's CPU kernels (cpu_kernels.py): "cpp", or "torch" ops
    # Per waiting prompt whose images this engine encodes in the step that starts it (vLLM
    # with image files; the embedded engine encodes at admission): its image tokens.
    waiting_image_tokens: tuple[int, ...] = ()
    # The request ids of ``waiting_prompt_lens``, in its order (the router drops its own
    # count of a prompt a report shows waiting); () where the engine does not say.
    waiting_request_ids: tuple[str, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks
