"""Attention over the paged KV pool, built from plain torch ops.

Per step, ``AttentionMetadata.build`` turns a ``ForwardBatch`` into index
tensors once; every layer then (1) writes the new tokens' K/V at their slots,
(2) gathers each sequence's whole blocks through its block table, and (3) runs
one ``scaled_dot_product_attention`` per group of sequences, padded to the
group's longest query and context, with an additive mask that is causal in
absolute positions (a query at position p sees keys 0..p of its own sequence).

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

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.engine.batch import ForwardBatch
from services.engine.cpu_kernels import PREFILL_KERNEL_HEAD_DIMS, CpuKernels

__all__ = ["AttentionMetadata", "PoolView", "SeqGroup", "paged_attention", "write_kv"]


@dataclass(slots=True)
class PoolView:
    """``kv[num_blocks, layers, 2, kv_heads, block_size, head_dim]`` as flat rows (no copy)."""

    kv: torch.Tensor  # the pool itself
    block_rows: torch.Tensor  # [num_blocks * layers * 2 * kv_heads, block_size * head_dim]
    token_rows: torch.Tensor  # [num_blocks * layers * 2 * kv_heads * block_size, head_dim]
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int

    @classmethod
    def of(cls, kv: torch.Tensor) -> PoolView:
        if not kv.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        _, num_layers, _, num_kv_heads, block_size, head_dim = kv.shape
        return cls(
            kv=kv,
            block_rows=kv.view(-1, block_size * head_dim),
            token_rows=kv.view(-1, head_dim),
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            head_dim=head_dim,
        )

    @property
    def heads_per_block(self) -> int:
        """Block rows per (block, layer): K and V of every head."""
        return 2 * self.num_kv_heads


@dataclass(slots=True)
class SeqGroup:
    """Sequences attended by one SDPA call, padded to ``max_query_len`` x context."""

    token_index: torch.Tensor | None  # [Tg] the group's tokens in step order; None: all, in order
    row: torch.Tensor | None  # [Tg] each token's sequence row (chunks only)
    col: torch.Tensor | None  # [Tg] each token's query column (chunks only)
    num_seqs: int
    max_query_len: int
    max_blocks: int
    gather_rows: torch.Tensor  # [2 * kv_heads * S * max_blocks] block rows of layer 0
    # For the C++ kernels (else None): [S, max_blocks] block ids, [S] context lengths;
    # for the prefill kernel also [S] each sequence's first token in the step and its
    # number of new tokens.
    block_table: torch.Tensor | None
    context_lens: torch.Tensor | None
    query_starts: torch.Tensor | None
    query_lens: torch.Tensor | None
    # Every sequence is a fresh prompt (no cached context): attend to this step's own K/V
    # with a plain causal mask, no gather. ``uniform``: all of equal length, no padding.
    fresh: bool
    uniform: bool
    mask: torch.Tensor  # [S, 1, group * max_query_len or 1, max_blocks * block_size]: 0 or -inf


@dataclass(slots=True)
class AttentionMetadata:
    # [T * 2 * kv_heads]: token rows of layer 0, in (token, k/v, head) order
    write_rows: torch.Tensor
    groups: list[SeqGroup]
    cpu_kernels: CpuKernels | None  # runs decode groups (and RoPE + KV writes) when set
    slots: torch.Tensor  # [T] pool slot of each new token (the batch's slot_mapping)
    sliding_window: int | None

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        *,
        pool: PoolView,
        num_queries_per_kv: int,
        sliding_window: int | None,
        device: torch.device,
        dtype: torch.dtype,
        cpu_kernels: CpuKernels | None = None,
    ) -> AttentionMetadata:
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        context_lens = np.asarray(batch.context_lens, dtype=np.int64)
        starts = np.cumsum(query_lens) - query_lens
        positions = batch.positions.to(device)
        groups = []
        for seqs in (np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens != 1)):
            if seqs.size:
                groups.append(
                    _build_group(
                        batch, seqs, query_lens, context_lens, starts, positions, pool,
                        num_queries_per_kv, sliding_window, device, dtype,
                        cpu_kernels is not None,
                    )
                )  # fmt: skip
        slots = batch.slot_mapping.cpu().numpy()
        bs, per_block = pool.block_size, pool.heads_per_block
        # token row = ((block * layers + layer) * 2 * kv_heads + c * kv_heads + h) * bs + offset
        first = (slots // bs) * (pool.num_layers * per_block * bs) + slots % bs
        write_rows = first[:, None] + np.arange(per_block, dtype=np.int64) * bs
        return cls(
            write_rows=_to_device(write_rows.reshape(-1), device),
            groups=groups,
            cpu_kernels=cpu_kernels,
            slots=batch.slot_mapping.to(device),
            sliding_window=sliding_window,
        )


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def _build_group(
    batch: ForwardBatch,
    seqs: np.ndarray,
    query_lens: np.ndarray,
    all_context_lens: np.ndarray,
    starts: np.ndarray,
    positions: torch.Tensor,
    pool: PoolView,
    group: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
    use_kernel: bool,
) -> SeqGroup:
    # Index arrays and the mask are built with numpy and become tensors in one call each:
    # per-sequence (or even per-array) torch ops would cost more than decode attention itself.
    num_seqs = int(seqs.size)
    group_query_lens = query_lens[seqs]
    context_lens = all_context_lens[seqs]
    max_query_len = int(group_query_lens.max())
    block_size = pool.block_size
    max_blocks = -(-int(context_lens.max()) // block_size)
    block_ids = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    for j, i in enumerate(seqs.tolist()):
        table = batch.block_tables[i][:max_blocks]
        block_ids[j, : len(table)] = table
    covers_all = num_seqs == len(batch.query_lens)
    kernel_decode = use_kernel and max_query_len == 1
    if use_kernel and max_query_len > 1 and pool.head_dim in PREFILL_KERNEL_HEAD_DIMS:
        # The prefill kernel reads the block tables and writes each query's own row.
        return SeqGroup(
            token_index=None, row=None, col=None, num_seqs=num_seqs,
            max_query_len=max_query_len, max_blocks=max_blocks,
            gather_rows=positions.new_empty(0), block_table=_to_device(block_ids, device),
            context_lens=_to_device(context_lens, device),
            query_starts=_to_device(starts[seqs], device),
            query_lens=_to_device(group_query_lens, device),
            fresh=False, uniform=False, mask=positions.new_empty(0),
        )  # fmt: skip
    fresh = (
        max_query_len > 1
        and sliding_window is None
        and bool((context_lens == group_query_lens).all())
    )
    # A sequence's new tokens sit at the end of its context.
    first_pos = context_lens - group_query_lens
    if max_query_len == 1:
        token_index = None if covers_all else _to_device(starts[seqs], device)
        row = col = None
        query_pos = first_pos[:, None]
    else:
        row_np = np.repeat(np.arange(num_seqs), group_query_lens)
        col_np = np.arange(row_np.size) - np.repeat(
            np.cumsum(group_query_lens) - group_query_lens, group_query_lens
        )
        token_np = starts[seqs][row_np] + col_np
        token_index = None if covers_all else _to_device(token_np, device)
        row, col = _to_device(row_np, device), _to_device(col_np, device)
        # Padding queries sit at position 0: they see key 0 only, so no row is all-masked (NaN).
        query_pos = np.zeros((num_seqs, max_query_len), dtype=np.int64)
        query_pos[row_np, col_np] = first_pos[row_np] + col_np
    if fresh or kernel_decode:
        mask = positions.new_empty(0)  # unused: causal attention and the kernel need none
    else:
        mask = _additive_mask(
            query_pos, max_blocks * block_size, group, sliding_window, device, dtype
        )
    return SeqGroup(
        token_index=token_index,
        row=row,
        col=col,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_blocks=max_blocks,
        gather_rows=positions.new_empty(0)
        if kernel_decode
        else _gather_rows(block_ids, pool, device),
        block_table=_to_device(block_ids, device) if kernel_decode else None,
        context_lens=_to_device(context_lens, device) if kernel_decode else None,
        query_starts=None,
        query_lens=None,
        fresh=fresh,
        uniform=bool((group_query_lens == max_query_len).all()),
        mask=mask,
    )


def _additive_mask(
    query_pos: np.ndarray,
    num_keys: int,
    group: int,
    sliding_window: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """0 where a query ([S, qlen] positions) may see a key, else -inf; heads folded in."""
    num_seqs, max_query_len = query_pos.shape
    if device.type == "cpu":
        # numpy's small ops cost about a third of torch's (~30 us a decode step).
        np_hidden = np.arange(num_keys) > query_pos[:, :, None]
        if sliding_window is not None:
            np_hidden |= np.arange(num_keys) <= query_pos[:, :, None] - sliding_window
        bias = torch.from_numpy(np.where(np_hidden, np.float32("-inf"), np.float32(0)))
        bias = bias.to(dtype)
    else:
        # On the device from the small position array: the mask (sequences x queries x
        # keys) can be large and should not cross from the host every step.
        q_pos = _to_device(query_pos, device)[:, :, None]
        key_pos = torch.arange(num_keys, device=device)
        hidden = key_pos > q_pos
        if sliding_window is not None:
            hidden |= key_pos <= q_pos - sliding_window
        bias = torch.zeros(hidden.shape, dtype=dtype, device=device)
        bias.masked_fill_(hidden, float("-inf"))
    # (Additive, in the activation dtype: SDPA would convert a boolean mask in every layer.)
    if max_query_len == 1:  # decode: one row per sequence, broadcast over heads
        return bias[:, None]
    return (
        bias[:, None, None]
        .expand(num_seqs, 1, group, max_query_len, num_keys)
        .reshape(num_seqs, 1, group * max_query_len, num_keys)
    )


def _gather_rows(block_ids: np.ndarray, pool: PoolView, device: torch.device) -> torch.Tensor:
    # block row = (block * layers + layer) * 2 * kv_heads + c * kv_heads + h, in (c, h, seq, block) order
    per_block = pool.heads_per_block
    first = block_ids.reshape(1, -1) * (pool.num_layers * per_block)
    rows = first + np.arange(per_block, dtype=np.int64).reshape(-1, 1)
    return _to_device(rows.reshape(-1), device)


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
    return o.view(g.num_seqs, num_heads * head_dim)


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
