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
    block_ids: torch.Tensor  # [S, max_blocks]: block tables, padded with block 0
    mask: torch.Tensor  # [S, 1, group * max_query_len, max_blocks * block_size] bool


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
    ) -> AttentionMetadata:
        slots = batch.slot_mapping.to(device)
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        decode = [i for i, q in enumerate(batch.query_lens) if q == 1]
        chunks = [i for i, q in enumerate(batch.query_lens) if q != 1]
        groups = [
            _build_group(
                batch, seqs, starts, block_size, num_queries_per_kv, sliding_window, device
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
) -> SeqGroup:
    query_lens = [batch.query_lens[i] for i in seqs]
    max_query_len = max(query_lens)
    max_blocks = max(-(-batch.context_lens[i] // block_size) for i in seqs)
    token_index: list[int] = []
    row: list[int] = []
    col: list[int] = []
    block_ids = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    for r, i in enumerate(seqs):
        q = batch.query_lens[i]
        token_index.extend(range(starts[i], starts[i] + q))
        row.extend([r] * q)
        col.extend(range(q))
        table = batch.block_tables[i][:max_blocks]
        block_ids[r, : len(table)] = torch.tensor(table, dtype=torch.int64)
    token_index_t = torch.tensor(token_index, dtype=torch.int64, device=device)
    row_t = torch.tensor(row, dtype=torch.int64, device=device)
    col_t = torch.tensor(col, dtype=torch.int64, device=device)
    # Padding queries sit at position 0: they see key 0 only, so no row is all-masked (NaN).
    query_pos = torch.zeros(len(seqs), max_query_len, dtype=torch.int64, device=device)
    query_pos[row_t, col_t] = batch.positions.to(device)[token_index_t]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]
    if sliding_window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    mask = (
        allowed[:, None, None]
        .expand(len(seqs), 1, group, max_query_len, key_pos.numel())
        .reshape(len(seqs), 1, group * max_query_len, key_pos.numel())
    )
    return SeqGroup(
        token_index=token_index_t,
        row=row_t,
        col=col_t,
        num_seqs=len(seqs),
        max_query_len=max_query_len,
        block_ids=block_ids.to(device),
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
    out = torch.empty_like(q)
    for g in meta.groups:
        s, qlen = g.num_seqs, g.max_query_len
        if qlen == 1:
            q_pad = q[g.token_index].view(s, 1, num_heads, head_dim)
        else:
            q_pad = q.new_zeros(s, qlen, num_heads, head_dim)
            q_pad[g.row, g.col] = q[g.token_index]
        # [S, qlen, kvh, group, d] -> [S, kvh, group * qlen, d]: heads sharing a KV head stack up.
        q_fold = (
            q_pad.view(s, qlen, num_kv_heads, group, head_dim)
            .permute(0, 2, 3, 1, 4)
            .reshape(s, num_kv_heads, group * qlen, head_dim)
        )
        # [S, blocks, 2, kvh, bs, d] -> K, V of [S, kvh, blocks * bs, d]
        ctx = layer_kv[g.block_ids]
        num_keys = g.block_ids.shape[1] * block_size
        k = ctx[:, :, 0].transpose(1, 2).reshape(s, num_kv_heads, num_keys, head_dim)
        v = ctx[:, :, 1].transpose(1, 2).reshape(s, num_kv_heads, num_keys, head_dim)
        o = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=g.mask, scale=scale)
        o = (
            o.view(s, num_kv_heads, group, qlen, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(s, qlen, num_heads, head_dim)
        )
        out[g.token_index] = o[g.row, g.col] if qlen > 1 else o.view(s, num_heads, head_dim)
    return out
