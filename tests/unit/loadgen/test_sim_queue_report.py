"""A simulated prefill worker reports its queue as the engine does between two steps:
every prompt token not yet computed, the chunks of the step in flight included."""

from __future__ import annotations

from loadgen.sim.profile import load_profile
from loadgen.sim.request import SimRequest
from loadgen.sim.worker import SimWorker
from router.types import Role


def _worker(budget_tokens: int, long_prefill_tokens: int) -> tuple[SimWorker, list[float]]:
    ends: list[float] = []
    noop = lambda *args: None  # noqa: E731
    w = SimWorker(
        "p0",
        Role.PREFILL,
        load_profile(),
        budget_tokens,
        lambda at, worker, version: ends.append(at),
        noop,
        noop,
        noop,
        noop,
        [],
        long_prefill_tokens=long_prefill_tokens,
    )
    return w, ends


def _request(request_id: str, tokens: int) -> SimRequest:
    return SimRequest(request_id, 0.0, tokens, 4, 4, ())


def test_a_report_mid_step_counts_the_chunks_in_flight() -> None:
    w, ends = _worker(budget_tokens=1000, long_prefill_tokens=0)
    for i, tokens in enumerate((300, 400, 900)):
        w.enqueue_prefill(_request(f"r{i}", tokens), 0.0)
    # The first prompt started alone; a request arriving now waits for it too.
    assert len(ends) == 1
    assert w.prompt_tokens_to_compute() == (300, 400, 900)
    w.end_step(ends[-1])
    # The second step takes 400 whole and 600 of the 900-token prompt (the budget): both
    # are still to compute until the step ends, the cut one in its place in the queue.
    assert w.prompt_tokens_to_compute() == (400, 900)
    w.end_step(ends[-1])
    assert w.prompt_tokens_to_compute() == (300,)
    w.end_step(ends[-1])
    assert w.prompt_tokens_to_compute() == ()


def test_with_a_long_prefill_threshold_a_short_prompt_overtakes_a_long_one() -> None:
    w, ends = _worker(budget_tokens=1000, long_prefill_tokens=200)
    for name, tokens in (("first", 50), ("long", 900), ("short", 100)):
        w.enqueue_prefill(_request(name, tokens), 0.0)
    assert w.prompt_tokens_to_compute() == (50, 900, 100)
    w.end_step(ends[-1])
    # Two prompts in the engine: the long one takes a 200-token chunk and the short one
    # runs whole beside it.
    assert w.prompt_tokens_to_compute() == (100, 900)
    w.end_step(ends[-1])
    assert w.prompt_tokens_to_compute() == (700,)  # alone now: the rest in one step
    w.end_step(ends[-1])
    assert w.prompt_tokens_to_compute() == ()
