"""The encode role's two ends: embeddings held by an encode worker, pulled by a prefill worker.

Owned by the engine loop (services/workers/loop.py) and called only from its thread,
like the engine and the connector. Call order::

    encode worker   encode(request)     engine.encode_images (encoder-output cache first)
                                        -> EmbeddingPool.store -> connector.hold("mm")
                                        -> ImagesEncoded(handle); the slots go back to the
                                        pool when the puller is done, on abort, or when
                                        the lease expires (on_release, queued to progress)
    prefill worker  start_pull(job)     EmbeddingPool.allocate -> connector.pull(handle, "mm"),
                                        one pull per part (``job.more_images``: images
                                        split over several encode workers)
                    progress()          each finished pull (every part DONE, or one
                                        FAILED): DONE -> the request, its images
                                        carrying their embeddings, ready for add_request
                                        (with an ImagesPulled event); FAILED -> a TRANSFER
                                        failure, and the gateway re-plans the request

Same lease, timeout and ``FAILED`` rules as KV blocks (kvtransfer/connector.py): an
encode worker that dies while holding embeddings fails the pull, never hangs it.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvtransfer.connector import KVConnector
from kvtransfer.types import TransferState
from services.engine.embedding_pool import MM_REGION, EmbeddingPool
from services.engine.messages import EngineRequest, InvalidRequestError
from services.workers.messages import (
    FailureKind,
    Generate,
    ImagesEncoded,
    ImagesPulled,
    RequestFailed,
    WorkerEvent,
)

__all__ = ["DEFAULT_NUM_SLOTS", "ImageStage", "PulledRequest"]

DEFAULT_NUM_SLOTS = 64  # images an encode worker holds at once (and a prefill worker lands)


@dataclass(frozen=True, slots=True)
class PulledRequest:
    """A pull that ended: the request to add (DONE) or the failure to send (FAILED)."""

    request: EngineRequest | None
    event: WorkerEvent


@dataclass(slots=True)
class _Pull:
    request: EngineRequest
    parts: list[tuple[str, list[int]]]  # (transfer_id, slots) per encode worker's part
    num_bytes: int
    started_s: float


class ImageStage:
    """Embeddings in the ``mm`` region; inert (``enabled`` False) for a text-only engine."""

    def __init__(
        self,
        worker_id: str,
        engine: Any,
        connector: KVConnector | None,
        num_slots: int = DEFAULT_NUM_SLOTS,
    ) -> None:
        self._worker_id = worker_id
        self._engine = engine
        self._connector = connector
        self._pool: EmbeddingPool | None = None
        self._held: dict[str, tuple[str, list[int]]] = {}  # request_id -> (transfer_id, slots)
        self._pulls: dict[str, _Pull] = {}  # request_id -> pull
        self._orphans: dict[str, list[int]] = {}  # aborted pulls' transfer_id -> slots
        self._released: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        shape = getattr(engine, "image_embedding_shape", None)
        if shape is None or connector is None:
            return
        layout = engine.kv_layout
        dtype = getattr(torch, layout.dtype)
        num_image_tokens, hidden_size = shape
        self._pool = EmbeddingPool(
            num_slots, num_image_tokens, hidden_size, dtype=dtype, device=layout.device
        )
        connector.register(MM_REGION, self._pool.storage, self._pool.layout)

    @property
    def enabled(self) -> bool:
        return self._pool is not None

    @property
    def can_encode(self) -> bool:
        """This worker can take the encode role: it has the pool and an engine that
        encodes (vLLM's lands pulled embeddings but has no encode-only step)."""
        return self._pool is not None and callable(getattr(self._engine, "encode_images", None))

    @property
    def num_pending_pulls(self) -> int:
        return len(self._pulls)

    @property
    def num_held(self) -> int:
        return len(self._held)

    # -- encode worker --------------------------------------------------------------
    def encode(self, request: EngineRequest) -> WorkerEvent:
        """Encode the request's images and hold their embeddings: ImagesEncoded, or a failure."""
        request_id = request.request_id
        pool, connector = self._pool, self._connector
        if pool is None or connector is None or not self.can_encode:
            return RequestFailed(request_id, FailureKind.INTERNAL, "this worker cannot encode")
        if not pool.can_allocate(len(request.images)):
            return RequestFailed(
                request_id, FailureKind.CAPACITY, "no free embedding slot on the encode worker"
            )
        started_s = time.monotonic()
        before = self._engine.stats().num_images_encoded
        try:
            embeddings = self._engine.encode_images(request.images)
        except InvalidRequestError as e:
            return RequestFailed(request_id, FailureKind.INVALID, str(e), e.param)
        num_encoded = self._engine.stats().num_images_encoded - before
        slots = pool.store(embeddings)
        on_release = functools.partial(self._on_release, request_id)
        handle = connector.hold(MM_REGION, slots, on_release=on_release)
        self._held[request_id] = (handle.transfer_id, slots)
        return ImagesEncoded(
            request_id,
            handle,
            num_images=len(slots),
            num_encoded=num_encoded,
            duration_s=time.monotonic() - started_s,
            worker_id=self._worker_id,
        )

    def _on_release(self, request_id: str, _slots: Sequence[int]) -> None:
        # The connector calls this inside progress/release (this thread) or, for some
        # backends, from its own: the pool is only touched in ``progress``.
        held = self._held.get(request_id)
        if held is not None:
            self._released.put((request_id, held[0]))

    # -- prefill worker -------------------------------------------------------------
    def start_pull(self, job: Generate) -> RequestFailed | None:
        """Land the embeddings ``job.images`` names; a failure to send, or None (pulling)."""
        request = job.request
        assert job.images is not None
        handles = (job.images, *job.more_images)  # one per encode worker's part, in order
        pool, connector = self._pool, self._connector
        if pool is None or connector is None:
            return RequestFailed(
                request.request_id, FailureKind.INTERNAL, "this worker cannot take embeddings"
            )
        if not pool.can_allocate(sum(len(h.block_ids) for h in handles)):
            return RequestFailed(request.request_id, FailureKind.CAPACITY, "no free embedding slot")
        parts: list[tuple[str, list[int]]] = []
        num_bytes = 0
        for handle in handles:
            slots = pool.allocate(len(handle.block_ids))
            try:
                transfer_id = connector.pull(handle, MM_REGION, slots)
            except Exception as e:  # KVTransferError, or NIXL's or torch's own: this request only
                pool.free(slots)
                for started_id, started_slots in parts:  # freed once they can't write
                    self._orphans[started_id] = started_slots
                return RequestFailed(
                    request.request_id, FailureKind.TRANSFER, f"image embeddings pull failed: {e}"
                )
            parts.append((transfer_id, slots))
            num_bytes += len(slots) * handle.layout.block_bytes
        self._pulls[request.request_id] = _Pull(request, parts, num_bytes, time.monotonic())
        return None

    # -- both ---------------------------------------------------------------------
    def progress(self) -> list[PulledRequest]:
        """Free released holds; finish the pulls that ended (call after connector.progress)."""
        self._free_released()
        if not self._pulls and not self._orphans:
            return []
        assert self._pool is not None and self._connector is not None
        for transfer_id, slots in list(self._orphans.items()):
            if _final_or_unknown(self._connector, transfer_id):
                del self._orphans[transfer_id]
                self._pool.free(slots)
        ended: list[PulledRequest] = []
        for request_id, pull in list(self._pulls.items()):
            states, reason = [], ""
            for transfer_id, _ in pull.parts:
                try:
                    states.append(self._connector.poll(transfer_id))
                except Exception as e:  # the backend's own error: this pull only
                    states.append(TransferState.FAILED)
                    reason = f": {e}"
            failed = any(s is TransferState.FAILED for s in states)
            if not failed and not all(s.is_final for s in states):
                continue  # the request is ready when its last part has landed
            del self._pulls[request_id]
            slots = [slot for _, part_slots in pull.parts for slot in part_slots]
            if not failed:
                embeddings = self._pool.load(slots)
                self._pool.free(slots)
                request = _with_embeddings(pull.request, embeddings)
                duration_s = time.monotonic() - pull.started_s
                ended.append(
                    PulledRequest(request, ImagesPulled(request_id, pull.num_bytes, duration_s))
                )
            else:
                for (transfer_id, part_slots), state in zip(pull.parts, states, strict=True):
                    if state.is_final:
                        self._pool.free(part_slots)
                    else:  # another part still in flight: freed once it cannot write
                        self._orphans[transfer_id] = part_slots
                message = f"image embeddings pull failed or timed out{reason}"
                failed_event = RequestFailed(request_id, FailureKind.TRANSFER, message)
                ended.append(PulledRequest(None, failed_event))
        return ended

    def abort(self, request_id: str) -> bool:
        """Drop the request's pull or hold; True if it had one."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None:  # its slots are free once the transfer can no longer write them
            for transfer_id, slots in pull.parts:
                self._orphans[transfer_id] = slots
            return True
        held = self._held.get(request_id)
        if held is not None and self._connector is not None:
            self._connector.release(held[0])  # fires on_release
            self._free_released()
            return True
        return False

    def _free_released(self) -> None:
        while True:
            try:
                request_id, transfer_id = self._released.get_nowait()
            except queue.Empty:
                return
            held = self._held.get(request_id)
            if held is not None and held[0] == transfer_id and self._pool is not None:
                del self._held[request_id]
                self._pool.free(held[1])


def _final_or_unknown(connector: KVConnector, transfer_id: str) -> bool:
    try:
        return connector.poll(transfer_id).is_final
    except Exception:  # the backend forgot it: nothing writes there any more
        return True


def _with_embeddings(request: EngineRequest, embeddings: torch.Tensor) -> EngineRequest:
    images = tuple(
        replace(image, embeddings=embeds, data=None)
        for image, embeds in zip(request.images, embeddings, strict=True)
    )
    return replace(request, images=images)
