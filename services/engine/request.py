"""A request's mutable state inside the engine (the messages in and out are frozen)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine.messages import EngineRequest, FinishReason, SamplingParams, TokenLogprob

__all__ = ["Request", "RequestStatus"]

_NO_IDS = torch.empty(0, dtype=torch.int64)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (also after a preemption)
    RUNNING = "running"  # holds blocks; moves num_computed_tokens toward num_tokens
    ADOPTING = "adopting"  # holds blocks being filled from elsewhere; not runnable yet
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    prefill_only: bool = False
    arrival_time_s: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_adopted_outputs: int = 0  # outputs generated before this engine saw the request
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's pool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    grammar: Any = None  # xgrammar.GrammarMatcher for a constrained request, set by the engine
    all_token_ids: list[int] = field(default_factory=list)  # prompt + outputs, kept in step
    # What the prefix cache hashes: all_token_ids itself, unless the prompt has images,
    # whose placeholders then read as their content (services/engine/block_hash.py).
    hash_token_ids: list[int] = field(default_factory=list)
    image_embeds: list[Any] = field(default_factory=list)  # (offset, [n, hidden]) per image
    # Prompt logprobs computed so far (tokens 1, 2, ...), while they are wanted and not yet
    # sent: None for a request that asked for none, continues one started elsewhere, or
    # has sent them with its first output.
    prompt_logprobs: list[TokenLogprob] | None = None
    _distinct_prompt_ids: Any = None  # torch int64, made on first use
    images: tuple[Any, ...] = ()  # its ImageInputs: resolved on demand (an adopted one's
    # KV arrived from elsewhere, so only a recompute after a preemption needs them)

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        self.hash_token_ids = self.all_token_ids

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.hash_token_ids is not self.all_token_ids:
            self.hash_token_ids.append(token_id)

    @classmethod
    def from_message(cls, message: EngineRequest) -> Request:
        return cls(
            request_id=message.request_id,
            prompt_token_ids=tuple(message.prompt_token_ids),
            sampling=message.sampling,
            prefill_only=message.prefill_only,
            arrival_time_s=message.arrival_time_s,
            output_token_ids=list(message.output_token_ids),
            num_adopted_outputs=len(message.output_token_ids),
            # A continuation's prompt logprobs went out with its first token, elsewhere.
            prompt_logprobs=[]
            if message.sampling.prompt_logprobs is not None and not message.output_token_ids
            else None,
        )

    def distinct_prompt_ids(self) -> Any:
        """The prompt's distinct token ids (a CPU int64 tensor; empty while the request
        has no repetition penalty, the one reader): made once, not per step."""
        if self.sampling.repetition_penalty == 1:
            return _NO_IDS
        if self._distinct_prompt_ids is None:
            prompt = torch.tensor(self.prompt_token_ids, dtype=torch.int64)
            self._distinct_prompt_ids = prompt.unique()
        return self._distinct_prompt_ids

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Prompt logprobs wanted and not all computed: its prompt runs without the prefix
        cache (a cached position has no logits)."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
