"""The plan executor against scripted worker clients: placement, hand-off, re-planning."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from kvtransfer.types import BlockHandle, KVLayout
from router.front_door import Router, RouterSettings
from router.policy import make_policy
from router.types import Role
from services.backends.fake import FakeTokenizer
from services.engine.messages import FinishReason, ImageInput, SamplingParams
from services.gateway.errors import BadRequest
from services.gateway.executor import ExecutorConfig, PlanExecutor
from services.gateway.placement import HoldSettings
from services.metrics import BatonMetrics
from services.workers.client import WorkerDiedError
from services.workers.messages import (
    Continue,
    FailureKind,
    Generate,
    Job,
    KVPulled,
    RequestFailed,
    TokenDelta,
    WorkerEvent,
    WorkerSnapshot,
)
from tests.unit.router.builders import FakePredictingPolicy

LAYOUT = KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=1, dtype="float32")
HANDLE = BlockHandle("local", "p", "kv", "t1", (3,), LAYOUT, expires_at_s=1e9)
PROMPT = tuple(range(65, 75))
A, B, C, D = (ord(c) for c in "abcd")

Script = Callable[[Job], Sequence[WorkerEvent | Exception]]


def snapshot(worker_id: str, role: Role) -> WorkerSnapshot:
    return WorkerSnapshot(
        worker_id=worker_id, role=role, draining=False, seq=1, time_s=0.0, block_size=16,
        num_total_blocks=64, num_free_blocks=64, num_cached_blocks=0, num_held_blocks=0,
        running=(), waiting_prompt_lens=(), recent_steps=(), recent_output_lens=(),
        num_preemptions=0, num_pending_pulls=0, num_finished_requests=0, kv_bytes_per_token=8,
        max_num_seqs=8, max_model_len=512,
    )  # fmt: skip


class ScriptedWorker:
    def __init__(self, worker_id: str, script: Script) -> None:
        self.worker_id = worker_id
        self.script = script
        self.jobs: list[Job] = []
        self.aborted: list[str] = []

    async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
        self.jobs.append(job)
        for event in self.script(job):
            if isinstance(event, Exception):
                raise event
            yield event

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def delta(token: int, finish: FinishReason | None = None, **kw: Any) -> TokenDelta:
    return TokenDelta("r", (token,), chr(token), finish, **kw)


def build(
    workers: list[tuple[ScriptedWorker, Role]],
) -> tuple[PlanExecutor, BatonMetrics, list[str]]:
    router = Router(RouterSettings(policy="round_robin", max_hold_s=0.0))
    for w, role in workers:
        router.update(snapshot(w.worker_id, role))
    by_id = {w.worker_id: w for w, _ in workers}
    died: list[str] = []

    def on_died(worker_id: str) -> None:
        died.append(worker_id)
        router.mark_dead(worker_id)
        by_id.pop(worker_id, None)

    metrics = BatonMetrics()
    executor = PlanExecutor(
        router, by_id.get, metrics,  # type: ignore[arg-type]
        ExecutorConfig("local", HoldSettings(max_hold_s=0.0)), on_died, FakeTokenizer(),
    )  # fmt: skip
    return executor, metrics, died


async def collect(executor: PlanExecutor, max_tokens: int = 4) -> list[TokenDelta]:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [d async for d in executor.run("r", PROMPT, sampling, 0.0)]


def prefill_script(job: Job) -> list[WorkerEvent]:
    return [delta(A, FinishReason.PREFILLED, handle=HANDLE)]


async def test_prefill_hands_off_to_decode_and_client_sees_one_stream() -> None:
    p = ScriptedWorker("p", prefill_script)
    d = ScriptedWorker(
        "d",
        lambda job: [KVPulled("r", 128, 0.001), delta(B), delta(C), delta(D, FinishReason.LENGTH)],
    )
    executor, metrics, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    out = await collect(executor)
    assert "".join(x.text for x in out) == "abcd"
    assert [x.finish_reason for x in out] == [None, None, None, FinishReason.LENGTH]
    assert all(x.handle is None for x in out)  # the handle never leaves the gateway
    (p_job,), (d_job,) = p.jobs, d.jobs
    assert isinstance(p_job, Generate) and p_job.request.prefill_only
    assert isinstance(d_job, Continue) and d_job.handle == HANDLE
    assert d_job.request.output_token_ids == (A,)
    assert p.aborted == [] and d.aborted == []
    assert metrics.transfer_bytes.labels("local")._value.get() == 128


async def test_the_router_is_told_each_image_s_tokens() -> None:
    m = ScriptedWorker("m", lambda job: [delta(A), delta(B, FinishReason.LENGTH)])
    executor, _, _ = build([(m, Role.MIXED)])
    seen = []
    place = executor._router.place

    def spy(profile: Any, now_s: float, **kw: Any) -> Any:
        seen.append(profile)
        return place(profile, now_s, **kw)

    executor._router.place = spy  # type: ignore[method-assign]
    images = (ImageInput("aa", 1, 3, data=b"x"), ImageInput("bb", 4, 5, data=b"y"))
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    out = [d async for d in executor.run("r", PROMPT, sampling, 0.0, images=images)]
    assert "".join(x.text for x in out) == "ab"
    (profile,) = seen  # sizes differ: the router cuts encode parts by them
    assert (profile.num_images, profile.num_image_tokens, profile.image_tokens) == (2, 8, (3, 5))
    assert profile.num_prompt_tokens == len(PROMPT) - 8


async def test_failed_pull_re_prefills_elsewhere_keeping_the_first_token() -> None:
    p = ScriptedWorker("p", prefill_script)
    d = ScriptedWorker(
        "d",
        lambda job: (
            [RequestFailed("r", FailureKind.TRANSFER, "timed out")]
            if isinstance(job, Continue)
            else [delta(B), delta(C), delta(D, FinishReason.LENGTH)]
        ),
    )
    executor, metrics, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    out = await collect(executor)
    assert "".join(x.text for x in out) == "abcd"
    retry = d.jobs[-1]
    assert isinstance(retry, Generate) and retry.request.output_token_ids == (A,)
    assert retry.request.request_id == "r.retry1"
    assert p.aborted == ["r"]  # the unpulled hold is released at once
    assert metrics.retries.labels("transfer")._value.get() == 1
    assert metrics.transfer_failures.labels("local")._value.get() == 1


async def test_decode_worker_death_continues_on_a_live_worker() -> None:
    p = ScriptedWorker(
        "p",
        lambda job: (
            prefill_script(job)
            if job.request.prefill_only
            else [delta(C), delta(D, FinishReason.LENGTH)]
        ),
    )
    d = ScriptedWorker("d", lambda job: [delta(B), WorkerDiedError("d")])
    executor, metrics, died = build([(p, Role.PREFILL), (d, Role.DECODE)])
    out = await collect(executor)
    assert "".join(x.text for x in out) == "abcd"
    assert died == ["d"]
    assert p.jobs[-1].request.output_token_ids == (A, B)
    assert metrics.retries.labels("worker_died")._value.get() == 1


async def test_invalid_request_is_a_bad_request_not_a_retry() -> None:
    w = ScriptedWorker("m", lambda job: [RequestFailed("r", FailureKind.INVALID, "no", "prompt")])
    executor, _, _ = build([(w, Role.MIXED)])
    with pytest.raises(BadRequest) as e:
        await collect(executor)
    assert e.value.param == "prompt" and len(w.jobs) == 1


async def test_stop_string_seen_at_the_gateway_ends_the_stream_and_aborts() -> None:
    w = ScriptedWorker("m", lambda job: [delta(A), delta(B), delta(C), delta(D)])
    executor, _, _ = build([(w, Role.MIXED)])
    sampling = SamplingParams(max_tokens=8, temperature=0.0, stop=("bc",))
    out = [d async for d in executor.run("r", PROMPT, sampling, 0.0)]
    assert "".join(x.text for x in out) == "a"
    assert out[-1].finish_reason is FinishReason.STOP
    assert w.aborted == ["r"]  # the worker did not finish on its own: told to stop


async def test_a_stop_string_inside_a_merged_delta_drops_the_tokens_after_it() -> None:
    """Deltas carry several tokens when the gateway lags; the stop string completes at the
    second of four: the rest are neither sent nor counted."""
    merged = TokenDelta("r", (A, B, C, D), "", None, num_output_tokens=4)
    w = ScriptedWorker("m", lambda job: [merged, delta(A, FinishReason.LENGTH)])
    executor, _, _ = build([(w, Role.MIXED)])
    for include, text in ((False, "a"), (True, "ab")):
        sampling = SamplingParams(
            max_tokens=8, temperature=0.0, stop=("b",), include_stop_str_in_output=include
        )
        (out,) = [d async for d in executor.run("r", PROMPT, sampling, 0.0)]
        assert out.text == text and out.finish_reason is FinishReason.STOP
        assert out.token_ids == (A, B) and out.num_output_tokens == 2


async def test_text_held_back_for_a_possible_stop_string_is_flushed_at_the_end() -> None:
    w = ScriptedWorker("m", lambda job: [delta(A), delta(B, FinishReason.LENGTH)])
    executor, _, _ = build([(w, Role.MIXED)])
    sampling = SamplingParams(max_tokens=2, temperature=0.0, stop=("bz",))
    out = [d async for d in executor.run("r", PROMPT, sampling, 0.0)]
    assert [d.text for d in out] == ["a", "b"]  # "b" waited: it might have begun "bz"
    assert out[-1].finish_reason is FinishReason.LENGTH


class AgeJudgingPolicy:
    """round_robin that refuses a request older than its TTFT target (a fake: tests only)."""

    def __init__(self) -> None:
        self.inner = make_policy("round_robin")
        self.rejected = 0

    def plan(self, profile: Any, view: Any, now_s: float) -> Any:
        from router.types import Reject

        ttft = profile.slo.ttft_s
        if ttft is not None and now_s - profile.arrival_s > ttft:
            self.rejected += 1
            return Reject("ttft target unreachable")
        return self.inner.plan(profile, view, now_s)


async def test_a_re_placed_request_is_never_refused_for_its_age() -> None:
    """A decode worker dies after the TTFT target has passed: the continuation is placed
    anyway (judged afresh, from its committed tokens) and the client's stream completes."""
    import asyncio
    import time

    from router.types import SLO

    class SlowDyingWorker(ScriptedWorker):
        async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
            self.jobs.append(job)
            yield delta(B)
            await asyncio.sleep(0.2)  # the request is now older than its 50 ms TTFT target
            raise WorkerDiedError(self.worker_id)

    p = ScriptedWorker(
        "p",
        lambda job: (
            prefill_script(job)
            if job.request.prefill_only
            else [delta(C), delta(D, FinishReason.LENGTH)]
        ),
    )
    d = SlowDyingWorker("d", lambda job: [])
    executor, _, died = build([(p, Role.PREFILL), (d, Role.DECODE)])
    policy = AgeJudgingPolicy()
    executor._router.policy = policy  # type: ignore[assignment]
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    slo = SLO(ttft_s=0.05)
    out = [x async for x in executor.run("r", PROMPT, sampling, time.monotonic(), slo=slo)]
    assert "".join(x.text for x in out) == "abcd" and died == ["d"]
    assert policy.rejected == 0
    # A new request that old is still refused: only re-placements are exempt.
    with pytest.raises(Exception, match="ttft target unreachable"):
        await anext(executor.run("r2", PROMPT, sampling, time.monotonic() - 1.0, slo=slo))


async def test_the_router_learns_the_link_and_holds_no_reservation_after_a_request() -> None:
    p = ScriptedWorker("p", prefill_script)
    d = ScriptedWorker(
        "d", lambda job: [KVPulled("r", 4_000_000, 0.5), delta(B), delta(C, FinishReason.LENGTH)]
    )
    executor, _, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    router = executor._router
    seed = router.link("d")
    await collect(executor)
    for worker_id in ("p", "d"):  # both ends of the pull
        link = router.link(worker_id)
        assert link != seed and link.bandwidth_bytes_per_s < 4_000_000 / 0.49
    assert router.num_reservations() == 0


async def test_no_room_on_the_decode_worker_is_re_placed_as_often_as_it_takes() -> None:
    """Decode memory is full for longer than ``max_attempts`` placements: the request is
    re-placed each time (never a 4xx/5xx for lack of decode memory) and completes once room
    frees; a real failure still counts against ``max_attempts``."""
    no_room = RequestFailed("r", FailureKind.CAPACITY, "no room to adopt: 9 blocks needed")
    num_full = 5  # > max_attempts (3)

    def decode(job: Job) -> list[WorkerEvent]:
        if len(d.jobs) <= num_full:
            return [no_room]
        return [delta(B), delta(C), delta(D, FinishReason.LENGTH)]

    p = ScriptedWorker("p", prefill_script)
    d = ScriptedWorker("d", decode)
    executor, metrics, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    out = await collect(executor)
    assert "".join(x.text for x in out) == "abcd"
    assert len(d.jobs) == num_full + 1
    assert metrics.retries.labels("capacity")._value.get() == num_full
    assert executor._router.num_reservations() == 0


async def test_a_finished_request_teaches_the_router_its_workers_observed_speed() -> None:
    """The executor measures TTFT from placement and TPOT between tokens and reports them,
    with the plan's predictions, through ``observe_outcome``: the router's per-worker
    correction moves from the identity towards what was seen."""
    from router.correction import Outcome

    seen: list[Outcome | None] = []
    p = ScriptedWorker("p", prefill_script)
    d = ScriptedWorker("d", lambda job: [delta(B), delta(C), delta(D, FinishReason.LENGTH)])
    executor, _, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    router = executor._router
    router.policy = FakePredictingPolicy(1e-6, 1e-6)  # type: ignore[assignment]
    observe = router.observe_outcome
    router.observe_outcome = lambda n, o=None: (seen.append(o), observe(n, o))  # type: ignore[method-assign]
    import time

    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    for i in range(router.corrector.settings.min_samples):
        [x async for x in executor.run(f"r{i}", PROMPT, sampling, time.monotonic())]
    outcome = seen[-1]
    assert outcome is not None and (outcome.prefill_worker, outcome.decode_worker) == ("p", "d")
    assert outcome.observed_ttft_s is not None and outcome.observed_ttft_s > 1e-6
    assert outcome.observed_tpot_s is not None and outcome.observed_tpot_s > 0
    assert router.corrector.ttft_s("p", 1e-6) > 1e-6


async def test_metrics_show_the_admission_share_fall_as_admitted_requests_miss() -> None:
    """The share moves only with requests admission judged: p prefills 20 ms after it is
    asked, past the 10 ms TTFT the plan promised to meet; placed unjudged, the same
    miss moves nothing."""
    import asyncio
    import time

    from router.types import SLO

    class SlowScriptedWorker(ScriptedWorker):
        async def generate(self, job: Job) -> AsyncIterator[WorkerEvent]:
            await asyncio.sleep(0.02)
            async for event in super().generate(job):
                yield event

    p = SlowScriptedWorker("p", prefill_script)
    d = ScriptedWorker("d", lambda job: [delta(B), delta(C), delta(D, FinishReason.LENGTH)])
    executor, metrics, _ = build([(p, Role.PREFILL), (d, Role.DECODE)])
    share = metrics.admission_share.labels
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    missed = SLO(ttft_s=0.01, tpot_s=60.0)
    [x async for x in executor.run("unjudged", PROMPT, sampling, time.monotonic(), slo=missed)]
    assert share("ttft")._value.get() == share("tpot")._value.get() == 1.0
    executor._router.policy = FakePredictingPolicy(1e-6, 1e-6)  # type: ignore[assignment]
    [x async for x in executor.run("judged", PROMPT, sampling, time.monotonic(), slo=missed)]
    guard = executor._router.admission.guard
    assert share("ttft")._value.get() == guard.ttft < 1.0
    assert share("tpot")._value.get() == 1.0


def test_observed_tpot_counts_decode_steps_not_the_hand_off() -> None:
    """The plan predicts TPOT as one decode step; the hand-off (KV pull, adopt) before the
    second token is the transfer's. A 2-token request has no decode step to report."""
    from router.types import Plan
    from services.gateway.executor import _Trace

    plan = Plan("p", "d", predicted_ttft_s=0.01, predicted_tpot_s=0.001)
    trace = _Trace(plan=plan, placed_s=0.0)
    trace.saw_tokens(0.01, 1)  # first token, from the prefill worker
    trace.saw_tokens(1.01, 2)  # after a 1 s hand-off
    two = trace.outcome()
    assert two is not None and two.observed_tpot_s is None
    trace.saw_tokens(1.03, 4)  # one delta with two tokens
    outcome = trace.outcome()
    assert outcome is not None and outcome.observed_tpot_s == pytest.approx(0.01)
    assert outcome.observed_ttft_s == pytest.approx(0.01)


def test_an_outcome_says_whether_the_client_saw_its_targets_met_hand_off_included() -> None:
    """TTFT counts from arrival (not placement) and TPOT over every token after the
    first, hand-off included, as the client's SLO is judged: 0.3 s waited + 0.01 s to the
    first token is within 0.5 s; 3 tokens after a 1 s hand-off average 0.34 s, past
    0.1 s, though the decode steps alone took 0.01 s each."""
    from router.types import Plan
    from services.gateway.executor import _Trace

    plan = Plan("p", "d", predicted_ttft_s=0.01, predicted_tpot_s=0.001)
    trace = _Trace(plan=plan, placed_s=0.3, arrival_s=0.0, ttft_target_s=0.5, tpot_target_s=0.1)
    trace.saw_tokens(0.31, 1)
    trace.saw_tokens(1.31, 2)
    trace.saw_tokens(1.33, 4)
    outcome = trace.outcome()
    assert outcome is not None and outcome.observed_tpot_s == pytest.approx(0.01)
    assert outcome.met_ttft is True and outcome.met_tpot is False
    late = _Trace(plan=plan, placed_s=0.3, arrival_s=0.0, ttft_target_s=0.3, tpot_target_s=0.5)
    late.saw_tokens(0.31, 1)
    late.saw_tokens(0.5, 2)
    missed = late.outcome()
    assert missed is not None and missed.met_ttft is False and missed.met_tpot is True
    unknown = _Trace(plan=plan, placed_s=0.0)
    unknown.saw_tokens(0.01, 1)
    assert unknown.outcome() is not None and unknown.outcome().met_ttft is None  # type: ignore[union-attr]
