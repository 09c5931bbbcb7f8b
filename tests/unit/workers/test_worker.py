"""The Worker object in-process (FakeEngine): streaming, telemetry cadence, role changes, aborts."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from kvtransfer import make_connector
from router.front_door import Router, RouterSettings
from router.policies.slo_goodput import SloGoodput
from router.types import Role, StepSample
from services.backends.fake import FakeEngine, FakeTokenizer
from services.engine.messages import EngineRequest, FinishReason, SamplingParams
from services.workers.messages import Continue, Generate, KVPulled, TokenDelta, WorkerSnapshot
from services.workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.asyncio

TOK = FakeTokenizer()


def request(rid: str, text: str = "hello", max_tokens: int = 8, **kw: object) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, tuple(TOK.encode(text)), sampling, **kw)  # type: ignore[arg-type]


def local_connector(agent: str):  # type: ignore[no-untyped-def]
    return make_connector("local", agent_name=agent, lease_s=1.0)


@pytest.fixture
async def worker():  # type: ignore[no-untyped-def]
    made: list[Worker] = []

    def make(role: Role = Role.MIXED, name: str = "w", **kw: object) -> Worker:
        spec = WorkerSpec(name, role, FakeEngine, telemetry_interval_s=0.05, **kw)  # type: ignore[arg-type]
        made.append(Worker(spec))
        return made[-1]

    yield make
    for w in made:
        await w.shutdown()


async def test_tokens_stream_as_they_are_produced(worker) -> None:  # type: ignore[no-untyped-def]
    w = worker()
    stream = w.generate(Generate(request("r", max_tokens=300)))
    # The first delta arrives long before the request ends. It is usually one step's
    # token, but deltas merge when this consumer is slow to be scheduled.
    first = await anext(stream)
    assert isinstance(first, TokenDelta) and 1 <= first.num_output_tokens < 300
    assert first.finish_reason is None and first.worker_id == "w"
    rest = [e async for e in stream]
    assert len(rest) >= 2  # streamed in pieces, not in one at the end
    tokens = [t for e in (first, *rest) if isinstance(e, TokenDelta) for t in e.token_ids]
    assert len(tokens) == 300 and rest[-1].finish_reason is FinishReason.LENGTH
    counts = [e.num_output_tokens for e in rest if isinstance(e, TokenDelta)]
    assert counts == sorted(counts) and counts[-1] == 300


async def test_a_lagging_consumer_gets_merged_deltas_with_nothing_lost(worker) -> None:  # type: ignore[no-untyped-def]
    w = worker()
    full = [t async for e in w.generate(Generate(request("a", max_tokens=40))) for t in e.token_ids]  # type: ignore[union-attr]
    merged: list[TokenDelta] = []
    async for e in w.generate(Generate(request("b", max_tokens=40))):
        assert isinstance(e, TokenDelta)
        merged.append(e)
        await asyncio.sleep(0.01)  # slower than the engine
    assert [t for e in merged for t in e.token_ids] == full
    assert len(full) == 40 and len(merged) < 40


async def test_telemetry_is_periodic_and_follows_admissions(worker) -> None:  # type: ignore[no-untyped-def]
    w = worker()
    seen: list[tuple[float, WorkerSnapshot]] = []

    async def watch() -> None:
        async for s in w.telemetry():
            seen.append((time.monotonic(), s))

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.3)
    idle = [t for t, _ in seen]
    gaps = [b - a for a, b in itertools.pairwise(idle)]
    assert len(idle) >= 4 and max(gaps) < 0.1  # every 50 ms, with slack
    n = len(seen)
    [e async for e in w.generate(Generate(request("r", max_tokens=3)))]
    await asyncio.sleep(0.02)
    after = [s for _, s in seen[n:]]
    assert any(s.num_finished_requests == 1 for s in after)
    assert [s.seq for _, s in seen] == sorted({s.seq for _, s in seen})
    task.cancel()


async def test_consumer_leaving_aborts_and_frees_blocks(worker) -> None:  # type: ignore[no-untyped-def]
    w = worker()
    stream = w.generate(Generate(request("r", max_tokens=400)))
    await anext(stream)
    busy = await w.snapshot()
    assert len(busy.running) == 1 and busy.num_used_blocks > 0
    await stream.aclose()
    await asyncio.sleep(0.05)
    idle = await w.snapshot()
    assert idle.running == () and idle.num_used_blocks == 0


async def test_set_role_drains_first(worker) -> None:  # type: ignore[no-untyped-def]
    w = worker(Role.PREFILL)
    stream = w.generate(Generate(request("r", max_tokens=400)))
    first = await anext(stream)
    flip = asyncio.create_task(w.set_role(Role.DECODE))
    await asyncio.sleep(0.01)
    draining = await w.snapshot()
    assert draining.draining and draining.role is Role.PREFILL and not flip.done()
    # Deltas may be merged when the consumer lags, so the finish can ride on any event.
    events = [first, *[e async for e in stream]]
    assert events[-1].finish_reason is FinishReason.LENGTH  # in-flight work finished
    assert await asyncio.wait_for(flip, 2.0) is Role.DECODE
    done = await w.snapshot()
    assert done.role is Role.DECODE and not done.draining


async def test_a_flip_to_mixed_keeps_the_work_in_flight_and_does_not_drain(worker) -> None:  # type: ignore[no-untyped-def]
    """Mixed takes every request prefill and decode take: the worker switches at once
    and its stream goes on."""
    w = worker(Role.PREFILL)
    stream = w.generate(Generate(request("r", max_tokens=400)))
    first = await anext(stream)
    assert await asyncio.wait_for(w.set_role(Role.MIXED), 0.5) is Role.MIXED
    flipped = await w.snapshot()
    assert flipped.role is Role.MIXED and not flipped.draining
    assert len(flipped.running) == 1  # still running: no drain
    events = [first, *[e async for e in stream]]
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_a_fixed_role_worker_keeps_its_role_and_keeps_serving(worker) -> None:  # type: ignore[no-untyped-def]
    """An encode worker on another engine than the text workers' (beside vLLM): a flip
    changes nothing and drains nothing; the caller learns the role it kept."""
    w = worker(Role.ENCODE, fixed_role=True)
    assert await asyncio.wait_for(w.set_role(Role.PREFILL), 1.0) is Role.ENCODE
    snap = await w.snapshot()
    assert snap.role is Role.ENCODE and not snap.draining


async def test_an_engine_that_cannot_encode_never_takes_the_encode_role(worker) -> None:  # type: ignore[no-untyped-def]
    """The planner may ask a prefill worker to encode; one whose engine has no encode
    step (vLLM's, the fake here) keeps its role, and still flips between text roles."""
    w = worker(Role.PREFILL, connector_factory=local_connector)
    assert await asyncio.wait_for(w.set_role(Role.ENCODE), 1.0) is Role.PREFILL
    assert (await w.snapshot()).role is Role.PREFILL
    assert await asyncio.wait_for(w.set_role(Role.DECODE), 1.0) is Role.DECODE


async def test_prefill_hold_is_pulled_by_decode_and_released(worker) -> None:  # type: ignore[no-untyped-def]
    p = worker(Role.PREFILL, "p", connector_factory=local_connector)
    d = worker(Role.DECODE, "d", connector_factory=local_connector)
    full = [e async for e in worker(Role.MIXED, "m").generate(Generate(request("x")))]
    (first,) = [e async for e in p.generate(Generate(request("x", prefill_only=True)))]
    assert isinstance(first, TokenDelta) and first.finish_reason is FinishReason.PREFILLED
    assert first.handle is not None and (await p.snapshot()).num_held_blocks == 1
    cont = request("x", output_token_ids=first.token_ids)
    events = [e async for e in d.generate(Continue(cont, first.handle))]
    assert (
        isinstance(events[0], KVPulled) and events[0].num_bytes == first.handle.layout.block_bytes
    )
    tokens = [
        *first.token_ids,
        *(t for e in events[1:] if isinstance(e, TokenDelta) for t in e.token_ids),
    ]
    assert tokens == [t for e in full if isinstance(e, TokenDelta) for t in e.token_ids]
    await asyncio.sleep(0.05)
    assert (await p.snapshot()).num_held_blocks == 0  # the pull's notification freed it


async def test_unpulled_hold_expires_with_its_lease(worker) -> None:  # type: ignore[no-untyped-def]
    p = worker(Role.PREFILL, "p2", connector_factory=local_connector)
    [_] = [e async for e in p.generate(Generate(request("y", prefill_only=True)))]
    assert (await p.snapshot()).num_held_blocks == 1
    await asyncio.sleep(1.3)  # lease_s = 1.0
    snap = await p.snapshot()
    assert snap.num_held_blocks == 0 and snap.num_used_blocks == 0


async def test_router_refits_from_each_engine_step_exactly_once(worker) -> None:  # type: ignore[no-untyped-def]
    """Every snapshot repeats the engine's recent steps; their engine-side ``end_s``
    lets the router's cost model take each step once, however many snapshots carry it."""
    w = worker()
    policy = SloGoodput()
    observed: list[StepSample] = []
    policy.cost_model("w").observe = observed.append  # type: ignore[method-assign]
    router = Router(RouterSettings(), policy=policy)
    snapshots: list[WorkerSnapshot] = []

    async def watch() -> None:
        async for s in w.telemetry():
            snapshots.append(s)

    task = asyncio.create_task(watch())
    for i in range(3):
        async for _ in w.generate(Generate(request(f"r{i}", max_tokens=4))):
            await asyncio.sleep(0.01)  # let telemetry interleave with the steps
    snapshots.append(await w.snapshot())
    task.cancel()
    for s in snapshots:
        router.update(s)
        policy.refresh(router.view())
    steps = snapshots[-1].recent_steps
    assert len(steps) >= 12  # 3 requests x 4 tokens, all still in the engine's history
    assert sum(len(s.recent_steps) for s in snapshots) > len(steps)  # repeated across snapshots
    ends = [s.end_s for s in steps]
    assert all(e > 0 for e in ends) and ends == sorted(set(ends))
    assert observed == list(steps)


async def test_nice_lowers_the_engine_threads_priority_only(worker) -> None:  # type: ignore[no-untyped-def]
    """``workers.nice``: the engine loop's thread runs at a higher nice value (Linux
    keeps one per thread), the worker's own thread, which answers the gateway, does not."""
    import os

    plain, niced = worker(name="a"), worker(name="b", nice=3)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    await asyncio.sleep(0.05)  # the loops have started
    tids = [w._loop._thread.native_id for w in (plain, niced)]
    assert [os.getpriority(os.PRIO_PROCESS, t) for t in tids] == [own, min(19, own + 3)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == own
    events = [e async for e in niced.generate(Generate(request("n", max_tokens=3)))]
    assert events[-1].finish_reason is FinishReason.LENGTH  # and it serves


def _may_lower_nice() -> bool:
    """Whether a thread here may lower its nice value (root, CAP_SYS_NICE or RLIMIT_NICE)."""
    import os
    import threading

    allowed: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        start = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, start + 1))
        try:
            os.setpriority(os.PRIO_PROCESS, tid, start)
            allowed.append(True)
        except PermissionError:
            allowed.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return allowed[0]


async def test_prefill_engines_run_at_prefill_nice_and_a_role_flip_moves_the_thread(worker) -> None:  # type: ignore[no-untyped-def]
    """``workers.prefill_nice``: a prefill engine's thread runs at it, a decode or mixed
    one at ``workers.nice``, and a role flip re-nices the thread to its new role's value.
    Lowering a nice value needs privilege: without it the thread keeps the value it has."""
    import os

    own = os.getpriority(os.PRIO_PROCESS, 0)
    w = worker(role=Role.PREFILL, nice=6, prefill_nice=2)
    await asyncio.sleep(0.05)  # the loop has started
    tid = w._loop._thread.native_id

    async def nice_settles_at(expected: int) -> int:
        for _ in range(100):
            if os.getpriority(os.PRIO_PROCESS, tid) == expected:
                break
            await asyncio.sleep(0.01)
        return os.getpriority(os.PRIO_PROCESS, tid)

    assert await nice_settles_at(own + 2) == own + 2
    assert await asyncio.wait_for(w.set_role(Role.DECODE), 1.0) is Role.DECODE
    assert await nice_settles_at(own + 6) == own + 6
    assert await asyncio.wait_for(w.set_role(Role.MIXED), 1.0) is Role.MIXED
    assert await nice_settles_at(own + 6) == own + 6
    assert await asyncio.wait_for(w.set_role(Role.PREFILL), 1.0) is Role.PREFILL
    back = own + 2 if _may_lower_nice() else own + 6
    assert await nice_settles_at(back) == back
    assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the worker's own thread is untouched
    events = [e async for e in w.generate(Generate(request("p", max_tokens=1)))]
    assert events[-1].finish_reason is FinishReason.LENGTH  # and it serves
