"""Turn a schedule into the model's flattened ``ForwardBatch`` (and back: which rows to sample)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.batch import ForwardBatch
from services.engine.kv_cache import BlockManager
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest

__all__ = ["StepInputs", "build_step_inputs"]


@dataclass(slots=True)
class StepInputs:
    batch: ForwardBatch
    sample_rows: list[int]  # rows of [T] whose logits are sampled (a sequence's last new token)
    sample_requests: list[Request]  # the requests that catch up this step, same order
    num_prefill_tokens: int
    num_decode_seqs: int


def build_step_inputs(scheduled: Sequence[ScheduledRequest], bm: BlockManager) -> StepInputs:
    """Gather every scheduled request's new tokens, positions and pool slots.

    A request samples only when this step brings ``num_computed_tokens`` to ``num_tokens``;
    a prefill chunk that stops short produces KV but no token.
    """
    bs = bm.block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_requests: list[Request] = []
    num_prefill_tokens = num_decode_seqs = 0
    for item in scheduled:
        r, n = item.request, item.num_new_tokens
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        table = bm.block_ids(r.request_id)
        if n == 1:  # decode: most sequences of most steps, so no ranges or generators
            input_ids.append(r.all_token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids.extend(r.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_lens.append(n)
        context_lens.append(end)
        block_tables.append(table)  # read within the step, before the next schedule grows it
        if end == r.num_tokens:
            sample_rows.append(len(input_ids) - 1)
            sample_requests.append(r)
        if n == 1 and start >= r.num_prompt_tokens:
            num_decode_seqs += 1
        else:
            num_prefill_tokens += n
    # One tensor for the three index rows: each torch.tensor call costs as much as a decode op.
    ids_pos_slots = torch.tensor((input_ids, positions, slots), dtype=torch.int64)
    batch = ForwardBatch(
        input_ids=ids_pos_slots[0],
        positions=ids_pos_slots[1],
        slot_mapping=ids_pos_slots[2],
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
    )
    return StepInputs(batch, sample_rows, sample_requests, num_prefill_tokens, num_decode_seqs)
