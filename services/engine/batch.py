"""The contract between the scheduler and the model: one flattened step.

The scheduler decides, for each scheduled sequence, how many new tokens to run
this step (``query_lens``: a prefill chunk, or 1 for decode). The model writes
those tokens' K/V into the paged pool at ``slot_mapping`` and attends over each
sequence's whole context through its ``block_tables``.

KV pool layout (see kvtransfer.types.KVLayout): one tensor
``kv[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; slot
``s`` is block ``s // block_size``, offset ``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ForwardBatch"]


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64: pool slot where each new token's K/V goes
    query_lens: list[int]  # per sequence: new tokens this step (sum == T)
    context_lens: list[int]  # per sequence: tokens in context after this step (cached + new)
    block_tables: list[list[int]]  # per sequence: block ids covering its context, in order

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        """Index into [T] of each sequence's last new token (whose logits are sampled)."""
        ends = torch.tensor(self.query_lens, dtype=torch.int64).cumsum(0)
        return ends - 1
