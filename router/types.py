"""What the router reads and returns. Pure data: no Ray, HTTP, torch or clocks.

``plan(profile, view, now_s) -> Plan | Reject`` is the whole contract; ``now_s``
is injected so the same policy objects run live and inside the simulator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "SLO",
    "ClusterView",
    "LengthClass",
    "Plan",
    "Priority",
    "Reject",
    "RequestProfile",
    "Role",
    "RunningRequest",
    "StepSample",
    "WorkerReport",
    "WorkerView",
]


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # serves both: colocated plans
    ENCODE = "encode"

    def does_all_of(self, other: Role) -> bool:
        """This role takes every request ``other`` takes (mixed: prefill's and
        decode's), so a worker flipping from ``other`` to it keeps its work in flight."""
        return self is other or (self is Role.MIXED and other in (Role.PREFILL, Role.DECODE))


class Priority(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class LengthClass(enum.StrEnum):
    SHORT = "short"
    LONG = "long"


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestProfile:
    request_id: str
    num_prompt_tokens: int
    num_new_tokens: int  # prompt tokens left after the predicted prefix hit
    max_tokens: int
    num_image_tokens: int = 0  # the prompt's image placeholders (not in num_prompt_tokens)
    num_images: int = 0
    slo: SLO = SLO()
    priority: Priority = Priority.INTERACTIVE
    prefix_hashes: tuple[int, ...] = ()  # hashes of the prompt's full blocks, in order
    arrival_s: float = 0.0  # when the gateway received it (same clock as now_s)
    # Each image's placeholder tokens, in order, where the sender knows them (they sum
    # to ``num_image_tokens``); (): the images are taken to be of equal size.
    image_tokens: tuple[int, ...] = ()

    def tokens_per_image(self) -> tuple[float, ...]:
        """Each image's tokens: ``image_tokens``, else ``num_image_tokens`` shared
        evenly over ``num_images`` (over one image if none is counted)."""
        if self.image_tokens:
            return self.image_tokens
        n = max(1, self.num_images)
        return (self.num_image_tokens / n,) * n


@dataclass(frozen=True, slots=True)
class RunningRequest:
    num_tokens_held: int  # c_i
    num_generated: int  # g_i
    max_tokens: int  # M_i


@dataclass(frozen=True, slots=True)
class StepSample:
    duration_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    total_context_tokens: int
    end_s: float = 0.0  # when the step ended (worker clock, monotonic): de-duplicates telemetry
    # Encodes that ran inside the step (an engine that encodes a prompt's images in the
    # step that prefills them, as vLLM does): requests, and their image tokens. Part of
    # ``duration_s``, which ``CostModel`` prices apart from the prefill (``step_s``).
    num_encodes: int = 0
    num_encoded_image_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: Role
    alive: bool = True
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    block_size: int = 16
    queued_tokens: dict[LengthClass, int] = field(default_factory=dict)  # prefill tokens waiting
    queued_requests: dict[LengthClass, int] = field(default_factory=dict)
    running: tuple[RunningRequest, ...] = ()
    recent_steps: tuple[StepSample, ...] = ()
    prefix_digest: frozenset[int] = frozenset()  # block hashes cached on this worker
    link_bandwidth_bytes_per_s: float = 0.0  # measured from transfers; 0: the profile's
    link_latency_s: float | None = None  # measured from transfers; None: the profile's
    kv_bytes_per_token: int = 0
    max_num_seqs: int = 256
    draining: bool = False
    prefill_budget_tokens: int = 0  # tokens one engine step prefills at most; 0: unknown
    # The engine's long_prefill_token_threshold: with others waiting, the most tokens one
    # request prefills in a step (0: none; see ``router.length.queue_wait_s``).
    long_prefill_tokens: int = 0
    inbound_tokens: int = 0  # KV of requests placed to decode here, not yet running here
    # Prompts queued here whose images this worker encodes before prefilling them
    # (encode colocated), and their image tokens: their encodes come before what
    # queues behind them.
    queued_encodes: int = 0
    queued_encode_tokens: int = 0
    # Prompts placed to prefill here whose images are still on encode workers, and their
    # prefill tokens: they join the queue when those answer (``Reservation.encoding``),
    # behind what is placed here before then.
    encoding_requests: int = 0
    encoding_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClusterView:
    workers: tuple[WorkerView, ...]
    recent_output_lens: tuple[int, ...] = ()  # finished requests' output lengths (history H)

    def by_role(self, *roles: Role) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.role in roles and w.alive and not w.draining)


@dataclass(frozen=True, slots=True)
class Plan:
    prefill_worker: str
    decode_worker: str | None  # None: colocated on prefill_worker
    encode_worker: str | None = None  # the encode worker of the first (or only) part
    length_class: LengthClass = LengthClass.SHORT
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    # One request's images split over several encode workers: (worker, first image,
    # end image) per part, in image order; () with ``encode_worker`` set: all on it.
    encode_parts: tuple[tuple[str, int, int], ...] = ()

    @property
    def colocated(self) -> bool:
        return self.decode_worker is None or self.decode_worker == self.prefill_worker

    @property
    def encode_workers(self) -> tuple[str, ...]:
        """Every encode worker the plan names, in part order (no repeats)."""
        if self.encode_parts:
            return tuple(dict.fromkeys(w for w, _, _ in self.encode_parts))
        return () if self.encode_worker is None else (self.encode_worker,)

    @property
    def text_workers(self) -> tuple[str, ...]:
        """The prefill worker, then the decode worker if it is another, in the order
        their first events come."""
        decode = self.decode_worker
        if decode is None or decode == self.prefill_worker:
            return (self.prefill_worker,)
        return (self.prefill_worker, decode)

    @property
    def workers(self) -> tuple[str, ...]:
        """Every worker the plan runs on: ``text_workers``, then ``encode_workers``."""
        return (*self.text_workers, *self.encode_workers)

    def encode_split(self, num_images: int) -> tuple[tuple[str, int, int], ...]:
        """The parts as (worker, first image, end image) for ``num_images`` images."""
        if self.encode_parts:
            return self.encode_parts
        if self.encode_worker is None or num_images <= 0:
            return ()
        return ((self.encode_worker, 0, num_images),)


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str
    retry_after_s: float = 1.0
    hold: bool = False  # True: targets still reachable, keep it at the gateway and ask again
    retryable: bool = True  # False: the same request would fail on an idle cluster too


class WorkerReport(Protocol):
    """What ``Router.update`` reads of a worker's telemetry (``WorkerSnapshot`` has it)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def role(self) -> Role: ...
    @property
    def draining(self) -> bool: ...
    @property
    def seq(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def running(self) -> tuple[RunningRequest, ...]: ...
    @property
    def waiting_prompt_lens(self) -> tuple[int, ...]: ...
    @property
    def waiting_image_tokens(self) -> tuple[int, ...]: ...
    @property
    def waiting_request_ids(self) -> tuple[str, ...]: ...
    @property
    def recent_steps(self) -> tuple[StepSample, ...]: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def prefix_digest(self) -> tuple[int, ...]: ...
    @property
    def prefill_budget_tokens(self) -> int: ...
    @property
    def long_prefill_tokens(self) -> int: ...
