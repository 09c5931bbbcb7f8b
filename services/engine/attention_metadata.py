"""A step's attention metadata: the paged pool as flat rows, and per group of
sequences the index tensors, block tables and masks its layers share.

``AttentionMetadata.build`` turns a ``ForwardBatch`` into these once per step (with
numpy, one tensor per array); ``attention.py`` runs every layer on them. Decode
sequences (one new token) and prefill chunks form separate groups, so a long chunk
does not pad every decode row to its length. Row indices into the pool are computed
for layer 0 and shifted per layer. With the C++ kernels a group needs only its block
table and lengths: no gather rows and no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.batch import ForwardBatch
from services.engine.cpu_kernels import PREFILL_KERNEL_HEAD_DIMS, CpuKernels

__all__ = ["AttentionMetadata", "PoolView", "SeqGroup"]


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
    """Sequences attended together: by one C++ kernel call, or by one SDPA call padded to
    ``max_query_len`` x context."""

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
    cpu_kernels: CpuKernels | None  # runs attention (and RoPE + KV writes) when set
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
    decode = max_query_len == 1
    if use_kernel and (decode or pool.head_dim in PREFILL_KERNEL_HEAD_DIMS):
        # The kernels read K/V through the block tables: no gather rows, no mask. The
        # decode kernel's queries are gathered by token (unless they are all the step's);
        # the prefill kernel reads and writes each sequence's own rows.
        starts_t = _to_device(starts[seqs], device)
        return SeqGroup(
            token_index=None if covers_all or not decode else starts_t, row=None, col=None,
            num_seqs=num_seqs, max_query_len=max_query_len, max_blocks=max_blocks,
            gather_rows=positions.new_empty(0), block_table=_to_device(block_ids, device),
            context_lens=_to_device(context_lens, device),
            query_starts=None if decode else starts_t,
            query_lens=None if decode else _to_device(group_query_lens, device),
            fresh=False, uniform=False, mask=positions.new_empty(0),
        )  # fmt: skip
    fresh = (
        max_query_len > 1
        and sliding_window is None
        and bool((context_lens == group_query_lens).all())
    )
    # A sequence's new tokens sit at the end of its context.
    first_pos = context_lens - group_query_lens
    if decode:
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
    if fresh:
        mask = positions.new_empty(0)  # unused: causal attention needs none
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
        gather_rows=_gather_rows(block_ids, pool, device),
        block_table=None,
        context_lens=None,
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
