"""Attention over the paged KV pool, built from plain torch ops.

Per step, ``AttentionMetadata.build`` (``attention_metadata.py``) turns a
``ForwardBatch`` into index tensors once; every layer then (1) writes the new
tokens' K/V at their slots, (2) gathers each sequence's whole blocks through its
block table, and (3) runs one ``scaled_dot_product_attention`` per group of
sequences, padded to the group's longest query and context, with an additive mask
that is causal in absolute positions (a query at position p sees keys 0..p of its
own sequence).

Decode sequences (one new token) and prefill chunks form separate groups, so a
long chunk does not pad every decode row to its length. Query heads are folded
onto their KV head (``[S, kv_heads, group * q_len, head_dim]``), so K/V are never
repeated for grouped-query attention.

The pool is addressed as flat rows (``PoolView``): one head's block
(``block_size * head_dim`` contiguous values) for gathers, one token of one
head for writes. Row indices are computed once per step for layer 0 and shifted
per layer, so each layer's gather is one contiguous ``index_select`` and each
write one ``index_copy_``; selecting the rows in (k/v, head, sequence, block)
order lays every sequence's keys out contiguously, with no second copy. At
decode on a CPU most of a step is per-op overhead, so the code counts ops.

With the C++ kernels (``cpu_kernels.py``, CPU), decode and prefill groups skip all of
this: the kernels read K/V through the block tables, and the prefill kernel writes each
query's row of the output itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.attention_metadata import AttentionMetadata, PoolView, SeqGroup

__all__ = ["paged_attention", "write_kv"]


def write_kv(
    pool: PoolView, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) of ``layer`` at the batch's slots."""
    rows = meta.write_rows + layer * pool.heads_per_block * pool.block_size
    pool.token_rows.index_copy_(0, rows, torch.stack((k, v), dim=1).view(-1, pool.head_dim))


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pool: PoolView,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, heads, d] (and this step's k/v [T, kv_heads, d]) -> [T, heads * d].

    The new K/V must already be in ``pool``; they are passed too so that fresh
    prompts can skip the gather.
    """
    num_tokens, num_heads, head_dim = q.shape
    out: torch.Tensor | None = None
    for g in meta.groups:
        if g.query_starts is not None:
            assert meta.cpu_kernels is not None and g.block_table is not None
            assert g.query_lens is not None and g.context_lens is not None
            if out is None:
                out = q.new_empty(num_tokens, num_heads * head_dim)
            meta.cpu_kernels.paged_prefill_(
                q, pool.kv, layer, g.block_table, g.query_starts, g.query_lens,
                g.context_lens, scale, meta.sliding_window, out,
            )  # fmt: skip
            continue
        if g.max_query_len == 1:
            o_tokens = _decode(q, pool, layer, meta, g, scale)
        elif g.fresh:
            o_tokens = _fresh_prefill(q, k_new, v_new, g, scale)
        else:
            o_tokens = _chunk(q, pool, layer, g, scale)
        if g.token_index is None:
            return o_tokens
        if out is None:
            out = q.new_empty(num_tokens, num_heads * head_dim)
        out[g.token_index] = o_tokens
    assert out is not None
    return out


def _gathered(pool: PoolView, layer: int, g: SeqGroup) -> torch.Tensor:
    """K and V of the group's whole blocks, one copy in the pool's (head, sequence)
    order: [2, kv_heads, S, max_blocks * block_size, d]."""
    rows = g.gather_rows + layer * pool.heads_per_block
    return pool.block_rows.index_select(0, rows).view(
        2, pool.num_kv_heads, g.num_seqs, g.max_blocks * pool.block_size, pool.head_dim
    )


def _gather(pool: PoolView, layer: int, g: SeqGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the group's whole blocks, [S, kv_heads, max_blocks * block_size, d]."""
    k_v = _gathered(pool, layer, g)
    return k_v[0].transpose(0, 1), k_v[1].transpose(0, 1)


def _decode(
    q: torch.Tensor, pool: PoolView, layer: int, meta: AttentionMetadata, g: SeqGroup, scale: float
) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    q_group = q if g.token_index is None else q[g.token_index]
    if meta.cpu_kernels is not None and g.block_table is not None:
        assert g.context_lens is not None
        return meta.cpu_kernels.paged_decode(
            q_group, pool.kv, layer, g.block_table, g.context_lens, scale, meta.sliding_window
        )
    q_fold = q_group.view(g.num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if q.device.type == "cpu":
        return _decode_bmm(q_fold, pool, layer, g, scale)
    k, v = _gather(pool, layer, g)
    o = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=g.mask, scale=scale)
    return o.reshape(g.num_seqs, num_heads * head_dim)  # CUDA kernels may return it strided


def _decode_bmm(
    q_fold: torch.Tensor, pool: PoolView, layer: int, g: SeqGroup, scale: float
) -> torch.Tensor:
    """Decode attention as two batched products and a softmax, in the gather's own
    (head, sequence) order. On a CPU, SDPA's flash kernel spends more on its tiling than
    on a few query rows against a few hundred keys: this is about 1.6x faster per layer
    at 16 sequences x 176 keys (one thread, AVX-512), with no copy of K or V."""
    s, kvh, group, d = q_fold.shape
    num_keys = g.max_blocks * pool.block_size
    k_v = _gathered(pool, layer, g).view(2, kvh * s, num_keys, d)
    q_hs = (q_fold * scale).transpose(0, 1).reshape(kvh * s, group, d)
    scores = torch.bmm(q_hs, k_v[0].transpose(1, 2)).view(kvh, s, group, num_keys)
    probs = torch.softmax(scores.add_(g.mask.view(1, s, 1, num_keys)), dim=-1)
    o = torch.bmm(probs.view(kvh * s, group, num_keys), k_v[1])  # [kvh * S, group, d]
    return o.view(kvh, s, group * d).transpose(0, 1).reshape(s, kvh * group * d)


def _chunk(q: torch.Tensor, pool: PoolView, layer: int, g: SeqGroup, scale: float) -> torch.Tensor:
    """Chunks after a cached prefix: padded queries over the gathered context."""
    assert g.row is not None and g.col is not None
    _, num_heads, head_dim = q.shape
    num_kv_heads = pool.num_kv_heads
    group = num_heads // num_kv_heads
    s, qlen = g.num_seqs, g.max_query_len
    k, v = _gather(pool, layer, g)
    q_pad = q.new_zeros(s, qlen, num_heads, head_dim)
    q_pad[g.row, g.col] = q if g.token_index is None else q[g.token_index]
    # [S, qlen, kvh, group, d] -> [S, kvh, group * qlen, d]: heads sharing a KV head stack up.
    q_fold = (
        q_pad.view(s, qlen, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(s, num_kv_heads, group * qlen, head_dim)
    )
    o = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=g.mask, scale=scale)
    o = o.view(s, num_kv_heads, group, qlen, head_dim).permute(0, 3, 1, 2, 4)
    return o[g.row, g.col].reshape(-1, num_heads * head_dim)


def _fresh_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: SeqGroup, scale: float
) -> torch.Tensor:
    """Whole prompts from position 0: causal attention over the step's own K/V."""
    _, num_heads, head_dim = q.shape
    s, qlen = g.num_seqs, g.max_query_len
    tensors = [t if g.token_index is None else t[g.token_index] for t in (q, k, v)]
    if g.uniform:
        q4, k4, v4 = (t.view(s, qlen, t.shape[1], head_dim).transpose(1, 2) for t in tensors)
    else:
        assert g.row is not None and g.col is not None
        padded = []
        for t in tensors:
            p = t.new_zeros(s, qlen, t.shape[1], head_dim)
            p[g.row, g.col] = t
            padded.append(p.transpose(1, 2))
        q4, k4, v4 = padded
    # Padding rows (past a short prompt) attend to padding keys; they are dropped below.
    o = _causal_sdpa(q4, k4, v4, scale).transpose(1, 2)  # [S, qlen, heads, d]
    if g.uniform:
        return o.reshape(s * qlen, num_heads * head_dim)
    return o[g.row, g.col].reshape(-1, num_heads * head_dim)


_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
