"""The Engine protocol: the seam between a worker and whatever runs the model.

Call order, owned by one worker thread (engines are not thread-safe)::

    engine.add_request(req)          validate (raises InvalidRequestError), enqueue
    while engine.has_unfinished():
        outputs = engine.step()      schedule -> run model -> sample -> detokenize
    engine.abort(request_id)         any time; frees the request's blocks

Disaggregation, with tokens counted rather than phases modelled:

* Prefill side: ``add_request(EngineRequest(..., prefill_only=True))``. The
  request runs like any other, stops after its first token with
  ``FinishReason.PREFILLED`` and its output carries ``held_kv`` (block ids,
  token count, layout). The engine keeps those blocks until
  ``release_held(request_id)``; the worker hands them to a KVConnector lease.
* Decode side: ``block_ids = adopt(req)`` where ``req.output_token_ids`` holds
  the first token. The engine allocates blocks for the prompt's KV and returns
  them for the caller to fill (a KV pull). ``start_adopted(request_id)`` then
  makes the request runnable: ``num_computed_tokens = len(prompt)``, and the
  next step computes the first token's KV and samples the second. On a failed
  fill, ``abort(request_id)`` frees the blocks.

Admission: the scheduler asks an ``AdmissionPolicy`` before it admits a
waiting request; the default admits on block availability, and the router's
past-future estimator is plugged in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvtransfer.types import KVLayout
from services.engine.messages import EngineRequest, EngineStats, RequestOutput, RunningRequestStats

__all__ = ["AdmissionFeedback", "AdmissionPolicy", "Engine", "ModelInfo"]


class ModelInfo(Protocol):
    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class AdmissionPolicy(Protocol):
    def can_admit(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: Sequence[RunningRequestStats],
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool: ...


@runtime_checkable
class AdmissionFeedback(Protocol):
    """Opt-in capability of an admission policy that learns from what happened.

    The engine reports each finished request's output length (the history a
    past-future estimator draws from) and each preemption (memory ran out
    anyway: a misprediction).
    """

    def observe_finished(self, output_len: int) -> None: ...

    def record_exhaustion(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def kv_storage(self) -> Any:
        """The KV pool tensor ``[num_blocks, *kv_layout.block_shape]`` (for a connector)."""
        ...

    def add_request(self, request: EngineRequest) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def release_held(self, request_id: str) -> None: ...

    def adopt(self, request: EngineRequest) -> list[int]: ...

    def start_adopted(self, request_id: str) -> None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...
