"""The hold line: held requests wait in arrival order and only the head asks the router
again; a request the line cannot serve in time is refused at once; each length class
has its own line."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from router.front_door import Router, RouterSettings
from router.length import LengthClassifier
from router.types import ClusterView, LengthClass, Plan, Reject, RequestProfile, Role
from services.backends.fake import FakeTokenizer
from services.engine.messages import FinishReason, SamplingParams
from services.gateway.errors import Overloaded
from services.gateway.executor import ExecutorConfig, PlanExecutor
from services.gateway.hold_line import HoldLine
from services.gateway.placement import HoldSettings
from services.metrics import BatonMetrics
from tests.unit.gateway.test_executor import ScriptedWorker, delta, snapshot

pytestmark = pytest.mark.asyncio

POLL_S = 0.01


@dataclass
class FakeGate:
    """A policy that holds every request until ``open``, then runs it on ``w``."""

    name: str = "fake_gate"
    open: bool = False
    num_plans: int = 0

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        self.num_plans += 1
        if not self.open:
            return Reject("no room yet", retry_after_s=POLL_S, hold=True)
        return Plan(prefill_worker="w", decode_worker=None)


LONG = 100  # prompt tokens: θ of the router ``gated_executor`` builds


@dataclass
class LongGate(FakeGate):
    """Holds long prompts until ``open``; short ones run on ``w`` at once."""

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject:
        if profile.num_prompt_tokens < LONG:
            return Plan(prefill_worker="w", decode_worker=None)
        return super().plan(profile, view, now_s)


def gated_executor(
    max_hold_s: float = 30.0, gate: FakeGate | None = None
) -> tuple[PlanExecutor, FakeGate, ScriptedWorker]:
    gate = gate or FakeGate()
    settings = RouterSettings(
        policy="round_robin", max_hold_s=max_hold_s, length_threshold_tokens=LONG
    )
    router = Router(settings, policy=gate)
    router.update(snapshot("w", Role.MIXED))
    worker = ScriptedWorker("w", lambda job: [delta(65, FinishReason.LENGTH)])
    config = ExecutorConfig("local", HoldSettings(max_hold_s=max_hold_s, hold_poll_s=POLL_S))
    executor = PlanExecutor(
        router, {"w": worker}.get, BatonMetrics(), config,  # type: ignore[arg-type]
        lambda _: None, FakeTokenizer(),
    )  # fmt: skip
    return executor, gate, worker


async def run_one(executor: PlanExecutor, request_id: str, num_tokens: int = 2) -> list[str]:
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = (65,) * num_tokens
    return [d.text async for d in executor.run(request_id, prompt, sampling, time.monotonic())]


async def test_only_the_head_of_the_line_asks_the_router_and_arrival_order_is_kept() -> None:
    executor, gate, worker = gated_executor()
    ids = [f"r{i}" for i in range(20)]
    tasks = []
    for rid in ids:
        tasks.append(asyncio.create_task(run_one(executor, rid)))
        await asyncio.sleep(0)  # arrive one after another
    await asyncio.sleep(0.3)  # 30 polls while everything is held
    held_plans = gate.num_plans
    # One decision per poll for the head (each of 20 on its own would be ~600).
    assert held_plans <= 0.3 / POLL_S + len(ids)
    gate.open = True
    await asyncio.gather(*tasks)
    assert [job.request.request_id for job in worker.jobs] == ids


async def test_a_request_is_refused_at_once_when_the_line_cannot_serve_it_in_time() -> None:
    line = HoldLine(window_s=2.0, min_departures=2)
    assert line.expected_wait_s(0.0) is None  # nobody waits
    for rid in ("a", "b", "c", "d"):
        line.join(rid, 0.0)
    # Nobody has left yet: a newcomer waits at least as long as the head has so far.
    assert line.expected_wait_s(0.3) == pytest.approx(0.3)
    line.leave("a", 0.5)
    line.leave("b", 1.0)  # 2 left in 2 s: 1 per second, 2 still waiting
    assert line.expected_wait_s(1.0) == pytest.approx(2.0)
    # Those departures aged out of the window; "c" has been the head since 1.0 s.
    assert line.expected_wait_s(3.6) == pytest.approx(2.6)

    executor, gate, _ = gated_executor(max_hold_s=1.0)
    first = asyncio.create_task(run_one(executor, "first"))
    await asyncio.sleep(0.05)
    line = executor._placer.lines[LengthClass.SHORT]
    line._departures.extend([time.monotonic()] * 2)  # 1 per s lately
    for rid in ("x", "y"):  # two more already waiting: ~3 s ahead of a newcomer
        line.join(rid, time.monotonic())
    with pytest.raises(Overloaded, match="held ahead"):
        await run_one(executor, "late")
    gate.open = True
    line.leave("x", 0.0)
    line.leave("y", 0.0)
    assert await first == ["A"]


async def test_a_waiter_whose_time_runs_out_leaves_without_waking_the_others() -> None:
    line = HoldLine()
    for rid in ("head", "second", "third"):
        line.join(rid, 0.0)
    assert await line.wait_turn("head", 0.0)
    assert not await line.wait_turn("third", 0.02)
    line.leave("third", 0.0)
    assert not await line.wait_turn("second", 0.0)  # the head is still there
    line.leave("head", 0.0)
    assert await line.wait_turn("second", 0.0)
    assert len(line) == 1


async def test_a_short_request_does_not_wait_behind_held_long_ones() -> None:
    """Long prompts held for their room (a one-worker long pool, say) hold up no short
    request: in one line it waited behind them, or was refused at once as "too many
    requests held ahead" when the line drained slowly."""
    executor, gate, _ = gated_executor(max_hold_s=2.0, gate=LongGate())
    longs = [asyncio.create_task(run_one(executor, f"long{i}", LONG)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert await asyncio.wait_for(run_one(executor, "short"), 0.5) == ["A"]
    assert not any(task.done() for task in longs)  # still held
    gate.open = True
    assert await asyncio.gather(*longs) == [["A"]] * 3


async def test_every_arrival_reaches_the_length_classes_once_even_behind_held_ones() -> None:
    """Requests that wait behind a held one of their class never reach ``place`` until
    their turn. Unobserved, a class held for its busy pool looked to the router like a
    class that stopped coming, which gives up its spatial pool worker: live, its held
    prompts then went to the other class's worker. Each arrival counts once, however
    often the head of its line asks again."""
    executor, gate, _ = gated_executor(max_hold_s=2.0, gate=LongGate())
    router = executor._router
    longs = []
    for i in range(6):  # the first is held; the others wait behind it
        longs.append(asyncio.create_task(run_one(executor, f"long{i}", LONG)))
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # the head asks again every poll
    for i in range(12):
        assert await run_one(executor, f"short{i}") == ["A"]
    assert len(executor._placer.lines[LengthClass.LONG]) == 6  # all still held

    seen = LengthClassifier(router.settings.profile.prefill, LONG)
    for num_tokens in [LONG] * 6 + [2] * 12:  # in arrival order, each once
        seen.observe(num_tokens)
    assert router.classifier.long_request_share == seen.long_request_share
    assert router.classifier.present_request_shares == seen.present_request_shares
    assert router.classifier.present_request_shares[1] > 0  # the long class is here
    gate.open = True
    assert await asyncio.gather(*longs) == [["A"]] * 6
