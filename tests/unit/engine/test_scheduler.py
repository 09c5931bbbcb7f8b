"""Scheduler: token budget, chunked prefill, preemption of the newest, admission hook."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.kv_cache import BlockManager
from services.engine.messages import RunningRequestStats, SamplingParams
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make_request(rid: str, n: int, start: int = 0, max_tokens: int = 8) -> Request:
    return Request(rid, tuple(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def make_scheduler(num_blocks: int = 64, **kw: int) -> Scheduler:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BlockManager(num_blocks, BS), **kw)


def run_step(s: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after the model ran: advance counters, sample when caught up."""
    for item in out.scheduled:
        r = item.request
        r.num_computed_tokens += item.num_new_tokens
        s.block_manager.cache_full_blocks(r.request_id, r.all_token_ids, r.num_computed_tokens)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(next_token)


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_prefill_and_decode_share_one_step_under_the_token_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=10)
    s.add(make_request("a", 6))
    out = s.schedule()
    assert scheduled(out) == {"a": 6}
    run_step(s, out)
    s.add(make_request("b", 20, start=100))
    out = s.schedule()
    # a decodes one token; b gets the rest of the budget as its first chunk.
    assert scheduled(out) == {"a": 1, "b": 9}
    run_step(s, out)
    out = s.schedule()
    assert scheduled(out) == {"a": 1, "b": 9}
    run_step(s, out)
    out = s.schedule()
    assert scheduled(out) == {"a": 1, "b": 2}


def test_long_prefill_threshold_lets_a_short_prompt_start_during_a_long_one() -> None:
    # Beside a decoding request, the long prompt goes in chunks of 8 (without the
    # threshold it takes 40 of the budget at once), and a short prompt that arrives
    # meanwhile runs whole in the next step beside its chunk.
    capped = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    whole = make_scheduler(max_num_batched_tokens=64)
    for s in (capped, whole):
        s.add(make_request("a", 3))
        run_step(s, s.schedule())  # a decodes from now on
        s.add(make_request("long", 40, start=100))
    out = capped.schedule()
    assert scheduled(out) == {"a": 1, "long": 8}
    assert scheduled(whole.schedule()) == {"a": 1, "long": 40}
    run_step(capped, out)
    capped.add(make_request("short", 5, start=200))
    out = capped.schedule()
    assert scheduled(out) == {"a": 1, "long": 8, "short": 5}
    for _ in range(3):
        run_step(capped, out)
        out = capped.schedule()
    assert scheduled(out) == {"a": 1, "long": 8, "short": 1}  # long's last 8 of 40


def test_long_prefill_threshold_spares_a_request_alone() -> None:
    # Nobody waits for a lone prompt: it takes the whole budget; a second request caps it.
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    s.add(make_request("long", 40))
    assert scheduled(s.schedule()) == {"long": 40}
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    s.add(make_request("b", 20))
    s.add(make_request("c", 30, start=100))
    assert scheduled(s.schedule()) == {"b": 8, "c": 8}


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_request(f"r{i}", 4, start=10 * i))
    out = s.schedule()
    assert set(scheduled(out)) == {"r0", "r1"}
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_newest_running_request_is_preempted_and_requeued_first() -> None:
    # 4 blocks: two requests of 7 tokens take 2 blocks each; decoding needs a third.
    s = make_scheduler(num_blocks=4)
    a, b = make_request("a", 7), make_request("b", 7, start=50)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert scheduled(out) == {"a": 7, "b": 7}
    run_step(s, out)
    out = s.schedule()
    assert scheduled(out) == {"a": 1, "b": 1}  # the 8th token still fits in 2 blocks
    run_step(s, out)  # the 9th token needs a third block for each
    s.add(make_request("c", 3, start=90))
    out = s.schedule()
    assert scheduled(out) == {"a": 1}
    assert out.preempted == [b]
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    # b is ahead of c; it will recompute its prompt plus its generated token.
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert b.num_uncomputed_tokens == 9


def test_a_lone_request_that_cannot_grow_preempts_itself() -> None:
    s = make_scheduler(num_blocks=3)
    a = make_request("a", 8)
    s.add(a)
    run_step(s, s.schedule())
    s.block_manager.allocate("squatter", list(range(500, 504)), 1)  # takes the last block
    out = s.schedule()
    assert out.preempted == [a] and out.scheduled == []


def test_preempted_request_recomputes_from_its_own_cached_blocks() -> None:
    s = make_scheduler(num_blocks=8)
    a = make_request("a", 9)
    s.add(a)
    run_step(s, s.schedule())
    s.abort("a")
    a2 = make_request("a2", 9)
    s.add(a2)
    out = s.schedule()
    assert scheduled(out) == {"a2": 1}
    assert a2.num_cached_tokens == 8 and s.num_prefix_hit_tokens == 8


class RefuseAll:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def can_admit(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        running: Sequence[RunningRequestStats],
        num_free_blocks: int,
        num_total_blocks: int,
        block_size: int,
    ) -> bool:
        self.calls.append((num_prompt_tokens, max_tokens))
        return False


def test_admission_policy_is_consulted_and_can_refuse() -> None:
    policy = RefuseAll()
    s = Scheduler(BlockManager(16, BS), max_num_seqs=4, max_num_batched_tokens=64, admission=policy)
    s.add(make_request("a", 5, max_tokens=3))
    out = s.schedule()
    assert out.scheduled == [] and policy.calls == [(5, 3)]
    assert s.has_unfinished()


def test_default_admission_waits_for_blocks_for_the_whole_prompt() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=4)
    s.add(make_request("big", 20))  # 6 blocks needed, 4 exist
    s.add(make_request("small", 3, start=100))
    out = s.schedule()
    # No overtaking: the small one waits behind the head of the queue.
    assert out.scheduled == []


def test_finish_frees_or_holds_blocks() -> None:
    s = make_scheduler(num_blocks=8)
    a, b = make_request("a", 5), make_request("b", 5, start=100)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())
    assert s.finish(a) == []
    held = s.finish(b, hold=True)
    assert len(held) == 2
    assert s.block_manager.num_held_blocks == 2
    assert not s.has_unfinished()
    s.abort("b")
    assert s.block_manager.num_held_blocks == 0


def test_abort_removes_from_any_queue_and_frees_blocks() -> None:
    s = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = make_request("a", 5), make_request("b", 5, start=100)
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())
    assert s.abort("b") is b and not s.waiting
    assert s.abort("a") is a and not s.running
    assert s.block_manager.num_free_blocks == 8
    assert s.abort("nope") is None


def test_adopted_requests_run_from_their_computed_tokens() -> None:
    s = make_scheduler(num_blocks=8)
    r = make_request("x", 6)
    r.append_output(42)
    s.block_manager.allocate_exact("x", 6)
    r.num_computed_tokens = 6
    s.add_adopted(r)
    out = s.schedule()
    assert scheduled(out) == {"x": 1}
    assert len(s.block_manager.block_ids("x")) == 2
