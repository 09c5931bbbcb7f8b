"""Random workloads through the scheduler and block manager keep the books balanced."""

from __future__ import annotations

from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st

from services.engine.kv_cache import BlockManager
from services.engine.messages import SamplingParams
from services.engine.request import Request
from services.engine.scheduler import Scheduler


def check_books(bm: BlockManager) -> None:
    """Each block is free xor referenced, and its count equals the tables and holds naming it."""
    refs: Counter[int] = Counter()
    for table in bm._tables.values():
        refs.update(table.block_ids)
    for held in bm._held.values():
        refs.update(held)
    free = set(bm._free_uncached) | set(bm._free_cached)
    assert len(free) == bm.num_free_blocks, "a block is free twice"
    for block_id in range(bm.num_total_blocks):
        assert bm.ref_count(block_id) == refs[block_id]
        assert (block_id in free) == (refs[block_id] == 0)
    for h, block_id in bm._cached.items():
        assert bm._blocks[block_id].block_hash == h


workload = st.lists(
    st.tuples(
        st.integers(1, 39),  # prompt length (< the 40-token context, as the engine enforces)
        st.integers(1, 30),  # max tokens
        st.integers(0, 3),  # prompt family (shared prefixes)
        st.booleans(),  # hold the blocks when finished
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(
    workload,
    st.integers(10, 20),
    st.integers(1, 6),
    st.integers(4, 32),
    st.integers(0, 2**31),
)
def test_random_workloads_finish_and_return_every_block(
    specs: list[tuple[int, int, int, bool]],
    num_blocks: int,
    max_num_seqs: int,
    budget: int,
    seed: int,
) -> None:
    bm = BlockManager(num_blocks, 4)
    s = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    hold: dict[str, bool] = {}
    for i, (n, max_tokens, family, held) in enumerate(specs):
        prompt = tuple((family * 1000 + j) for j in range(n))
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
        hold[r.request_id] = held
        s.add(r)
    finished: list[str] = []
    for step in range(500):
        if not s.has_unfinished():
            break
        # A puller takes held blocks one step after the prefill finished (a lease ends).
        for rid in finished:
            bm.release_held(rid)
        out = s.schedule()
        assert out.num_scheduled_tokens <= budget
        assert len(s.running) <= max_num_seqs
        for item in out.scheduled:
            r = item.request
            r.num_computed_tokens += item.num_new_tokens
            assert len(bm.block_ids(r.request_id)) * 4 >= r.num_computed_tokens
            bm.cache_full_blocks(r.request_id, r.all_token_ids, r.num_computed_tokens)
            if r.num_computed_tokens == r.num_tokens:
                r.append_output((seed + step) % 97)
                # Cap at 40 tokens so that a request always fits in the 10-block minimum pool.
                if r.num_output_tokens >= r.sampling.max_tokens or r.num_tokens >= 40:
                    s.finish(r, hold=hold[r.request_id])
                    finished.append(r.request_id)
        check_books(bm)
    assert sorted(finished) == sorted(hold), "every request finishes"
    event(f"preempted: {s.num_preemptions > 0}")
    for rid in finished:
        bm.release_held(rid)
    check_books(bm)
    assert bm.num_free_blocks == num_blocks
