"""What crosses the boundary between the gateway and a worker actor.

Gateway -> worker (arguments of ``Worker.generate``)::

    Generate(request)            run a request (full, or prefill-only when
                                 ``request.prefill_only``) on this worker
    Continue(request, handle)    adopt a request whose prompt KV another worker
                                 holds: pull it through the KVConnector, then decode
    Encode(request)              encode worker: run the vision tower and projector on
                                 the request's images, hold the embeddings under a lease
    Generate(request, images=h)  as Generate, but first pull the images' embeddings
                                 (from every part's encode worker: ``more_images``)
                                 that an encode worker holds (handle ``h``)

Worker -> gateway, per request and in order::

    KVPulled                     only for Continue, once the KV landed
    ImagesEncoded                only for Encode, final: the embeddings' handle
    ImagesPulled                 only for Generate with ``images``, once they landed
    TokenDelta ...               one per engine step that produced tokens;
                                 the last has ``finish_reason`` set
    RequestFailed                instead of (or after some) deltas; final

Across a process boundary these travel in ``EventBatch`` messages, one per
engine step per gateway, holding every request's events of that step
(``services/workers/channel.py``). Workers send token ids only: the gateway
owns text (detokenizing, stop strings), so ``TokenDelta.text`` is empty until
the gateway's detokenizer fills it.

and, on the ``telemetry`` stream, ``WorkerSnapshot`` at least every
``telemetry_interval_s`` and after every admission or finish.

Everything is a frozen, slotted dataclass: small to pickle, immutable once sent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtransfer.types import BlockHandle
from router.types import Role, RunningRequest, StepSample
from services.engine.messages import EngineRequest, FinishReason, TokenLogprob

__all__ = [
    "Continue",
    "Encode",
    "EventBatch",
    "FailureKind",
    "Generate",
    "ImagesEncoded",
    "ImagesPulled",
    "Job",
    "KVPulled",
    "RequestFailed",
    "TokenDelta",
    "WorkerEvent",
    "WorkerSnapshot",
]


@dataclass(frozen=True, slots=True)
class Generate:
    request: EngineRequest
    images: BlockHandle | None = None  # embeddings an encode worker holds for its images
    # Images split over several encode workers: the later parts' embeddings, each held
    # by its own encode worker, in image order (``images`` holds the first part's).
    more_images: tuple[BlockHandle, ...] = ()


@dataclass(frozen=True, slots=True)
class Encode:
    request: EngineRequest  # only its images (with their data) matter


@dataclass(frozen=True, slots=True)
class Continue:
    request: EngineRequest  # output_token_ids holds the tokens generated elsewhere
    handle: BlockHandle


Job = Generate | Continue | Encode


class FailureKind(enum.StrEnum):
    INVALID = "invalid"  # the engine refused the request (HTTP 400)
    TRANSFER = "transfer"  # the KV pull failed or timed out: re-plan
    CAPACITY = "capacity"  # no room to adopt: re-plan elsewhere
    INTERNAL = "internal"  # anything else the worker caught


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: str
    token_ids: tuple[int, ...]
    text: str  # "" from a worker; the gateway's detokenizer fills it
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # with a request's first token
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, tokens generated elsewhere included
    num_cached_tokens: int = 0
    handle: BlockHandle | None = None  # set on a prefill-only request's last delta
    worker_id: str = ""  # who produced it


@dataclass(frozen=True, slots=True)
class KVPulled:
    request_id: str
    num_bytes: int
    duration_s: float


@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: str
    kind: FailureKind
    message: str
    param: str | None = None


@dataclass(frozen=True, slots=True)
class ImagesEncoded:
    """An Encode's last event: the request's image embeddings, held for a puller."""

    request_id: str
    handle: BlockHandle  # region ``mm``: one slot per image, in prompt order
    num_images: int
    num_encoded: int  # of those, run through the encoder now (the rest: cache hits)
    duration_s: float
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class ImagesPulled:
    request_id: str
    num_bytes: int
    duration_s: float


WorkerEvent = TokenDelta | KVPulled | RequestFailed | ImagesEncoded | ImagesPulled


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One transport message: the events of one or more engine steps for one gateway."""

    events: tuple[WorkerEvent, ...]


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """A worker's state as the router needs it (DESIGN 3, worker telemetry)."""

    worker_id: str
    role: Role
    draining: bool
    seq: int  # increases with every snapshot of this worker
    time_s: float  # worker's monotonic clock when taken
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_held_blocks: int
    running: tuple[RunningRequest, ...]
    waiting_prompt_lens: tuple[int, ...]
    recent_steps: tuple[StepSample, ...]
    recent_output_lens: tuple[int, ...]
    num_preemptions: int
    num_pending_pulls: int
    num_finished_requests: int  # since start, prefill-only ones included
    kv_bytes_per_token: int
    max_num_seqs: int
    max_model_len: int
    prefix_digest: tuple[int, ...] = ()  # hashes of cached full blocks (block_hash.py)
    prefill_budget_tokens: int = 0  # tokens one engine step computes at most; 0: unknown
    long_prefill_tokens: int = 0  # the engine's long_prefill_token_threshold (0: none)
    num_images_encoded: int = 0  # since start: images run through the vision encoder
    num_image_cache_hits: int = 0  # since start: images served by the encoder-output cache
    # Per waiting prompt whose images this worker encodes before its prefill (vLLM
    # encodes files in the step that starts the prompt): its image tokens.
    waiting_image_tokens: tuple[int, ...] = ()
    # The request ids of ``waiting_prompt_lens``, in its order: the router stops counting
    # its own reservation of a prompt a snapshot shows waiting (() where not known).
    waiting_request_ids: tuple[str, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks
