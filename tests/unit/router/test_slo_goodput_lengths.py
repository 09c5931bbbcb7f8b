"""slo_goodput's length classes: queues as the engine serves them, the spatial pool and
its size, on constructed views (``builders.PROFILE``; see test_slo_goodput.py)."""

from __future__ import annotations

from router.types import LengthClass, Role
from tests.unit.router.builders import plan_of, policy, request, view, worker


def test_short_requests_pass_long_work_only_where_the_engine_chunks_it() -> None:
    def cluster(long_prefill_tokens: int):
        return view(
            # Queued: one 8000-token prompt, 0.81 s of work; with a 512-token long-prefill
            # threshold a short arrival waits for one chunk of it, 0.06 s.
            worker(
                "p_long_q",
                Role.PREFILL,
                long_tokens=8000,
                long_requests=1,
                long_prefill_tokens=long_prefill_tokens,
            ),
            worker("p_short_q", Role.PREFILL, short_tokens=2000, short_requests=2),  # 0.22 s
            worker("d", Role.DECODE),
        )

    for long_prefill_tokens, short_goes_to in ((0, "p_short_q"), (512, "p_long_q")):
        pol = policy(length_threshold_tokens=256)
        v = cluster(long_prefill_tokens)
        short = plan_of(pol.plan(request(50), v, 0.0))
        assert short.prefill_worker == short_goes_to and short.length_class is LengthClass.SHORT
        long = plan_of(pol.plan(request(2000), v, 0.0))
        assert long.prefill_worker == "p_short_q" and long.length_class is LengthClass.LONG


def test_spatial_split_sends_each_class_to_its_pool() -> None:
    v = view(
        worker("p0", Role.PREFILL, short_tokens=1000, short_requests=1),
        worker("p1", Role.PREFILL),  # the long pool: the last half by id
        worker("d", Role.DECODE),
    )
    pol = policy(length_split="spatial", prior_long_share=0.5, length_threshold_tokens=256)
    assert plan_of(pol.plan(request(50), v, 0.0)).prefill_worker == "p0"
    assert plan_of(pol.plan(request(2000), v, 0.0)).prefill_worker == "p1"
    assert (
        plan_of(policy(length_threshold_tokens=256).plan(request(50), v, 0.0)).prefill_worker
        == "p1"
    )


def test_spatial_pool_follows_the_long_share_onto_every_prefilling_worker() -> None:
    """Only long prompts: both prefill workers take them, and a mixed worker of the pool
    prefills one colocated (with a fixed share of workers one prefill worker idled and
    the other queued them all); only short prompts again, and the pool empties."""
    pol = policy(length_split="spatial", length_threshold_tokens=256, colocate_roles=(Role.MIXED,))
    v = view(
        worker("p0", Role.PREFILL),
        worker("p1", Role.PREFILL, long_tokens=3000, long_requests=1),
        worker("d", Role.DECODE),
    )
    assert plan_of(pol.plan(request(50), v, 0.0)).prefill_worker == "p0"  # the prior: p1 long
    assert plan_of(pol.plan(request(2000), v, 0.0)).prefill_worker == "p1"  # behind 3000
    for _ in range(100):
        pol.plan(request(2000), v, 0.0)
    assert plan_of(pol.plan(request(2000), v, 0.0)).prefill_worker == "p0"  # now in the pool
    # A link too slow for any transfer: the mixed worker, in the pool, runs it whole.
    slow = view(
        worker("p0", Role.PREFILL, bandwidth=1e7),
        worker("m", Role.MIXED, bandwidth=1e7),
        worker("d", Role.DECODE, bandwidth=1e7),
    )
    long = plan_of(pol.plan(request(2000), slow, 0.0))
    assert long.colocated and long.prefill_worker == "m"
    assert pol._table.long_pool.size == 2
    for _ in range(600):
        pol.plan(request(50), v, 0.0)
    assert pol._table.long_pool.size == 0


def test_spatial_split_never_colocates_a_long_prompt_beside_short_ones() -> None:
    """An idle decode host is the cheapest place for a long prefill (no transfer), but
    under the spatial split it would hold up the short prefills colocated there."""
    v = view(worker("p0", Role.PREFILL), worker("p1", Role.PREFILL), worker("d", Role.DECODE))
    coloc = {"colocate_roles": (Role.MIXED, Role.DECODE), "length_threshold_tokens": 256}
    temporal = policy(**coloc)
    assert plan_of(temporal.plan(request(2000), v, 0.0)).prefill_worker == "d"  # colocated
    spatial = policy(length_split="spatial", prior_long_share=0.5, **coloc)
    long = plan_of(spatial.plan(request(2000), v, 0.0))
    assert (long.prefill_worker, long.decode_worker) == ("p1", "d")
    assert plan_of(spatial.plan(request(50), v, 0.0)).prefill_worker in {"p0", "d"}


def test_long_prompts_after_a_phase_of_short_ones_take_every_worker_within_a_few() -> None:
    """Two mixed workers (a 2-worker cluster the planner pooled) after a phase of short
    prompts only: a long prompt goes to the idle one within a few long requests, the
    short class being gone. With the decayed request share alone the short class kept
    that worker, idle, for 58 requests: a whole live phase of long prompts queued on
    the other one."""
    pol = policy(length_split="spatial", length_threshold_tokens=256, colocate_roles=(Role.MIXED,))
    v = view(
        worker("m0", Role.MIXED),  # the short host while both classes come
        worker("m1", Role.MIXED, long_tokens=3000, long_requests=1),  # the long pool
    )
    for _ in range(60):
        assert plan_of(pol.plan(request(50), v, 0.0)).prefill_worker == "m0"
    hosts = [plan_of(pol.plan(request(2000), v, 0.0)).prefill_worker for _ in range(16)]
    # The first goes to the idle worker (no long prompt came for a while: the class was
    # gone too), the next few to the pool, then, the short class gone, to either.
    assert hosts[1] == "m1" and hosts[-4:] == ["m0"] * 4, hosts
