"""The cheaper view upkeep decides exactly as the code it replaced (issue #13's speed).

Each test keeps the replaced implementation here as the reference and checks, on
randomized inputs, that the router's inputs to ``policy.plan`` come out bit for bit
the same: the cost model's fitted coefficients, each worker's view (queues by length
class, running set with reservations, free blocks, inbound KV) and the sorted
output-length history. The policy is deterministic given these, so the plans are
the same; the last test places randomized requests while it checks every view.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import replace

import numpy as np
import pytest

from router.cost_model import CostModel, _features, _solve_non_negative
from router.estimator import OutputLengthHistory, sample_output_lengths
from router.front_door import Router, RouterSettings
from router.policies.slo_goodput import SloGoodput
from router.profile import DEFAULT_PROFILE
from router.types import LengthClass, Plan, RequestProfile, Role, RunningRequest, StepSample
from services.workers.messages import WorkerSnapshot


def _reference_theta(model: CostModel, xs: deque[list[float]], ys: deque[float]) -> np.ndarray:
    """``CostModel.refit`` as it was: the window kept as deques."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    weights = model.decay ** np.arange(len(y) - 1, -1, -1, dtype=np.float64) / (y * y)
    ref = np.array(
        [1.0, model.ref_tokens, model.ref_tokens**2, 1.0, model.ref_seqs, model.ref_context]
    )
    p, d = model.profile.prefill, model.profile.decode
    theta0 = np.array([p.a, p.b, p.c, d.a, d.b, d.c], dtype=np.float64)
    at_ref = theta0 * ref
    curve_s = np.repeat([at_ref[:3].sum(), at_ref[3:].sum()], 3)
    prior = model.prior_weight / np.maximum(curve_s, 1e-12) ** 2
    xs_ = x / ref
    xw = xs_ * weights[:, None]
    gram = xw.T @ xs_ + np.diag(prior)
    rhs = xw.T @ y + prior * at_ref
    # The solve itself (non-negative) is the model's: this test is about the window.
    theta: np.ndarray = _solve_non_negative(gram, rhs) / ref
    return theta


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_models_ring_window_fits_what_the_deque_window_fitted(seed: int) -> None:
    rng = random.Random(seed)
    model = CostModel(DEFAULT_PROFILE, window=rng.choice((16, 64, 256)))
    xs: deque[list[float]] = deque(maxlen=model.window)
    ys: deque[float] = deque(maxlen=model.window)
    fits = 0
    for k in range(3 * model.window + rng.randrange(50)):
        n = rng.choice((0, rng.randint(1, 8192)))
        batch = 0 if n and rng.random() < 0.5 else rng.randint(1, 256)
        context = batch * rng.randint(10, 4000)
        sample = StepSample(rng.uniform(1e-3, 0.5), n, batch, context, end_s=float(k))
        model.observe(sample)
        xs.append(_features(n, batch, context))  # the model's: this test is about the window
        ys.append(sample.duration_s)
        if model.num_samples % model.refit_every == 0:
            fits += 1
            assert np.array_equal(model._theta, _reference_theta(model, xs, ys))
    assert fits > 3 * model.window // model.refit_every - 1


@pytest.mark.parametrize("count", [0, 1, 50, 99, 100, 150, 199, 200, 201, 777])
def test_the_policys_history_is_the_output_length_history_it_replaced(count: int) -> None:
    rng = random.Random(count)
    lengths = tuple(rng.randint(1, 4000) for _ in range(count))
    policy = SloGoodput()
    policy._refresh_history(lengths)
    window = policy.history_window
    expected = OutputLengthHistory(
        policy.prior_output_len,
        window=window,
        num_prior=window // 2,
        lengths=lengths[-window:],
    ).sorted_lengths()
    assert np.array_equal(policy._table.sorted_history, expected)
    # The candidates' ring, drawn a row at a time, as the replaced code drew it at once:
    # one (g, cap) pair per draw, by numpy.
    u = np.array(policy._ring_u).reshape(1, -1)
    zeros = np.zeros(u.shape[1])
    uncapped = np.full(u.shape[1], float(expected[-1]) + 1.0)
    ring = sample_output_lengths(expected, zeros, uncapped, u).reshape(-1, policy.num_draws)
    rows = [policy._next_candidate() for _ in range(len(ring))]
    assert np.array_equal(np.array(rows), ring)


def _snapshot(rng: random.Random, wid: str, role: Role, seq: int) -> WorkerSnapshot:
    running = tuple(
        RunningRequest(rng.randint(10, 3000) + (g := rng.randint(0, 300)), g, 400)
        for _ in range(rng.randint(0, 12) if role is not Role.PREFILL else 0)
    )
    return WorkerSnapshot(
        worker_id=wid,
        role=role,
        draining=False,
        seq=seq,
        time_s=float(seq),
        block_size=16,
        num_total_blocks=4000,
        num_free_blocks=rng.randint(0, 4000),
        num_cached_blocks=0,
        num_held_blocks=0,
        running=running,
        waiting_prompt_lens=tuple(rng.randint(1, 3000) for _ in range(rng.randint(0, 6))),
        recent_steps=(),
        recent_output_lens=(),
        num_preemptions=0,
        num_pending_pulls=0,
        num_finished_requests=0,
        kv_bytes_per_token=1024,
        max_num_seqs=256,
        max_model_len=32768,
        prefix_digest=(),
    )


def _reference_view_fields(r: Router, wid: str) -> tuple[object, ...]:
    """``Router._worker_view`` as it was, reduced to what it computed."""
    s = r.live.report(wid)
    assert s is not None
    classify = r.classifier.classify
    queued_tokens = {LengthClass.SHORT: 0, LengthClass.LONG: 0}
    queued_requests = {LengthClass.SHORT: 0, LengthClass.LONG: 0}
    for n in s.waiting_prompt_lens:
        cls = classify(n)
        queued_tokens[cls] += n
        queued_requests[cls] += 1
    running = list(s.running)
    num_free_blocks = s.num_free_blocks
    inbound_tokens = 0
    for res in r._reservations.on(wid):
        started = res.started_seq is not None  # its first event came where it runs
        if res.plan.prefill_worker == wid and not started:
            queued_tokens[res.length_class] += res.prefill_tokens
            queued_requests[res.length_class] += 1
        if (res.plan.decode_worker or res.plan.prefill_worker) == wid:
            num_free_blocks -= math.ceil((res.held_tokens + 1) / s.block_size)
            running.append(RunningRequest(res.held_tokens, 0, res.max_tokens))
            if res.plan.prefill_worker != wid and not started:
                inbound_tokens += res.held_tokens
    same = len(running) == len(s.running)
    return (
        queued_tokens,
        queued_requests,
        s.running if same else tuple(running),
        max(0, num_free_blocks),
        inbound_tokens,
    )


@pytest.mark.parametrize("seed", range(6))
def test_views_and_plans_equal_the_replaced_view_on_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    router = Router(RouterSettings(policy="slo_goodput", length_split="temporal"))
    roles = {f"w{i}": (Role.PREFILL, Role.DECODE, Role.MIXED)[i % 3] for i in range(9)}
    seqs = dict.fromkeys(roles, 0)
    for wid, role in roles.items():
        seqs[wid] += 1
        router.update(_snapshot(rng, wid, role, seqs[wid]))
    placed: list[str] = []
    num_plans = 0
    for k in range(300):
        action = rng.random()
        if action < 0.3:
            wid = rng.choice(list(roles))
            seqs[wid] += 1
            router.update(_snapshot(rng, wid, roles[wid], seqs[wid]))
        elif action < 0.4 and placed:
            rid = placed.pop(rng.randrange(len(placed)))
            router.release(rid, rng.choice((None, *roles)))
        else:
            prompt = rng.randint(1, 6000)
            profile = RequestProfile(f"r{k}", prompt, prompt, rng.randint(1, 400))
            decision = router.place(replace(profile, arrival_s=k * 0.01), k * 0.01)
            if isinstance(decision, Plan):
                placed.append(profile.request_id)
                num_plans += 1
        for wid in roles:  # rebuilt now, under today's θ, as the reference is
            router.live.invalidate(wid)
        view = {w.worker_id: w for w in router.view().workers}
        for wid in roles:
            w = view[wid]
            got = (w.queued_tokens, w.queued_requests, w.running, w.num_free_blocks)
            assert (*got, w.inbound_tokens) == _reference_view_fields(router, wid)
            if not router._reservations.on(wid):  # nothing reserved: the report's own tuple
                report = router.live.report(wid)
                assert report is not None and w.running is report.running
    assert num_plans > 20
