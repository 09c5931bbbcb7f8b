"""Attention over the paged KV pool, built from plain torch ops.

Per step, ``AttentionMetadata.build`` turns a ``ForwardBatch`` into index
tensors once; every layer then (1) writes the new tokens' K/V at their slots,
(2) gathers each sequence's whole blocks through its block table, and (3) runs
one ``scaled_dot_product_attention`` per group of sequences, padded to the
group's longest query and context, with a boolean mask that is causal in
absolute positions (a query at position p sees keys 0..p of its own sequence).

Decode sequences (one new token) and prefill chunks form separate groups, so a
long chunk does not pad every decode row to its length. Query heads are folded
onto their KV head (``[S, kv_heads, group * q_len, head_dim]``), so K/V are never
repeated for grouped-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.batch import ForwardBatch

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]


@dataclass(slots=True)
class SeqGroup:
    """Sequences attended by one SDPA call, padded to ``max_query_len`` x context."""

    token_index: torch.Tensor  # [Tg]: the group's tokens in the step's [T] order
    row: torch.Tensor  # [Tg]: each token's sequence row in the padded batch
    col: torch.Tensor  # [Tg]: each token's query column in the padded batch
    num_seqs: int
    max_query_len: int
    block_ids: torch.Tensor  # [S * max_blocks]: block tables, padded with block 0, flattened
    max_blocks: int
    covers_all_tokens: bool  # token_index is 0..T-1: the group is the whole step
    mask: torch.Tensor  # [S, 1, group * max_query_len or 1, max_blocks * block_size]: 0 or -inf


@dataclass(slots=True)
class AttentionMetadata:
    write_blocks: torch.Tensor  # [T]
    write_offsets: torch.Tensor  # [T]
    groups: list[SeqGroup]

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        *,
        block_size: int,
        num_queries_per_kv: int,
        sliding_window: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> AttentionMetadata:
        slots = batch.slot_mapping.to(device)
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        decode = [i for i, q in enumerate(batch.query_lens) if q == 1]
        chunks = [i for i, q in enumerate(batch.query_lens) if q != 1]
        groups = [
            _build_group(
                batch, seqs, starts, block_size, num_queries_per_kv, sliding_window, device, dtype
            )
            for seqs in (decode, chunks)
            if seqs
        ]
        return cls(
            write_blocks=torch.div(slots, block_size, rounding_mode="floor"),
            write_offsets=slots % block_size,
            groups=groups,
        )


def _build_group(
    batch: ForwardBatch,
    seqs: list[int],
    starts: list[int],
    block_size: int,
    group: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> SeqGroup:
    # Index lists are built in Python and turned into tensors in one call each:
    # per-sequence tensor ops would cost more than the attention itself at decode.
    query_lens = [batch.query_lens[i] for i in seqs]
    max_query_len = max(query_lens)
    max_blocks = max(-(-batch.context_lens[i] // block_size) for i in seqs)
    tables = []
    for i in seqs:
        table = batch.block_tables[i][:max_blocks]
        tables.append(table + [0] * (max_blocks - len(table)))
    token_index = [t for i in seqs for t in range(starts[i], starts[i] + batch.query_lens[i])]
    token_index_t = torch.tensor(token_index, dtype=torch.int64, device=device)
    query_pos_flat = batch.positions.to(device)[token_index_t]
    if max_query_len == 1:
        row_t = col_t = token_index_t  # unused for decode
        query_pos = query_pos_flat[:, None]
    else:
        row = [r for r, q in enumerate(query_lens) for _ in range(q)]
        col = [c for q in query_lens for c in range(q)]
        row_t = torch.tensor(row, dtype=torch.int64, device=device)
        col_t = torch.tensor(col, dtype=torch.int64, device=device)
        # Padding queries sit at position 0: they see key 0 only, so no row is all-masked (NaN).
        query_pos = torch.zeros(len(seqs), max_query_len, dtype=torch.int64, device=device)
        query_pos[row_t, col_t] = query_pos_flat
    key_pos = torch.arange(max_blocks * block_size, device=device)
    allowed = key_pos <= query_pos[:, :, None]
    if sliding_window is not None:
        allowed &= key_pos > query_pos[:, :, None] - sliding_window
    # An additive mask in the activation dtype: SDPA would convert a boolean one in every layer.
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
        ~allowed, float("-inf")
    )
    if max_query_len == 1:  # decode: one row per sequence, broadcast over heads
        mask = bias[:, None]
    else:
        mask = (
            bias[:, None, None]
            .expand(len(seqs), 1, group, max_query_len, key_pos.numel())
            .reshape(len(seqs), 1, group * max_query_len, key_pos.numel())
        )
    return SeqGroup(
        token_index=token_index_t,
        row=row_t,
        col=col_t,
        num_seqs=len(seqs),
        max_query_len=max_query_len,
        block_ids=torch.tensor(tables, dtype=torch.int64, device=device).view(-1),
        max_blocks=max_blocks,
        covers_all_tokens=len(token_index) == batch.num_tokens,
        mask=mask,
    )


def write_kv(
    layer_kv: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) into ``layer_kv[num_blocks, 2, kv_heads, block_size, head_dim]``."""
    layer_kv[meta.write_blocks, :, :, meta.write_offsets] = torch.stack((k, v), dim=1)


def paged_attention(
    q: torch.Tensor, layer_kv: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, heads, head_dim] -> [T, heads, head_dim], attending over the cached context."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = layer_kv.shape[2], layer_kv.shape[3]
    group = num_heads // num_kv_heads
    out = q.new_empty(q.shape) if len(meta.groups) > 1 else q  # q is only a placeholder
    for g in meta.groups:
        s, qlen = g.num_seqs, g.max_query_len
        q_group = q if g.covers_all_tokens else q[g.token_index]
        if qlen == 1:
            q_fold = q_group.reshape(s, num_kv_heads, group, head_dim)
        else:
            q_pad = q.new_zeros(s, qlen, num_heads, head_dim)
            q_pad[g.row, g.col] = q_group
            # [S, qlen, kvh, group, d] -> [S, kvh, group * qlen, d]: heads sharing a KV head stack up.
            q_fold = (
                q_pad.view(s, qlen, num_kv_heads, group, head_dim)
                .permute(0, 2, 3, 1, 4)
                .reshape(s, num_kv_heads, group * qlen, head_dim)
            )
        # One gather lays the context out as [2, kvh, S, blocks * block_size, d]: selecting
        # blocks along a middle dim makes each sequence's keys contiguous, with no second copy.
        k_v = (
            layer_kv.permute(1, 2, 0, 3, 4)
            .index_select(2, g.block_ids)
            .view(2, num_kv_heads, s, g.max_blocks * block_size, head_dim)
            .transpose(1, 2)
        )
        o = F.scaled_dot_product_attention(q_fold, k_v[0], k_v[1], attn_mask=g.mask, scale=scale)
        if qlen == 1:
            o_tokens = o.view(s, num_heads, head_dim)
        else:
            o = (
                o.view(s, num_kv_heads, group, qlen, head_dim)
                .permute(0, 3, 1, 2, 4)
                .reshape(s, qlen, num_heads, head_dim)
            )
            o_tokens = o[g.row, g.col]
        if g.covers_all_tokens:
            return o_tokens
        out[g.token_index] = o_tokens
    return out
