"""``slo_goodput``'s per-request shortcuts give the values of the code they replaced
(issue #13's speed): the plain step where no worker prefills in chunks, and the few
prefix-matched workers' effective lengths in Python floats. The replaced computations
are kept here as the reference."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.policies import SloGoodput
from router.policies.slo_checks import colocated_tpot_s
from router.types import ClusterView, LengthClass, RequestProfile, Role, RunningRequest, WorkerView
from router.worker_table import WorkerTable


def _reference_colocated_tpot_s(t: WorkerTable, n: float | np.ndarray, mean: float) -> np.ndarray:
    queued = t.queued_tokens + n
    chunks = np.ceil(queued / np.maximum(t.chunk_tokens, 1.0))
    stall_s = chunks * t.chunk_fixed_s + t.chunk_s_per_token * queued
    out: np.ndarray = t.step_base_s + stall_s / mean
    return out


def _reference_prefill_tokens(t: WorkerTable, profile: RequestProfile) -> np.ndarray:
    matched = t.prefix_index.matched_blocks(profile.prefix_hashes)
    total = profile.num_prompt_tokens + profile.num_image_tokens
    n = np.full(len(t.role), float(total))
    if matched:
        index = np.fromiter(matched.keys(), dtype=np.intp, count=len(matched))
        blocks = np.fromiter(matched.values(), dtype=np.float64, count=len(matched))
        n[index] = np.maximum(1.0, total - blocks * t.block_size[index])
    return n


def _view(rng: random.Random, budget: int) -> ClusterView:
    workers = []
    for i in range(12):
        role = (Role.PREFILL, Role.DECODE, Role.MIXED)[i % 3]
        running = tuple(
            RunningRequest(rng.randint(10, 3000), rng.randint(0, 300), 512)
            for _ in range(rng.randint(0, 9) if role is not Role.PREFILL else 0)
        )
        queued = rng.randint(0, 5000)
        workers.append(
            WorkerView(
                worker_id=f"w{i}",
                role=role,
                num_total_blocks=4000,
                num_free_blocks=rng.randint(0, 4000),
                block_size=rng.choice((16, 32)),
                queued_tokens={LengthClass.SHORT: queued, LengthClass.LONG: 0},
                queued_requests={LengthClass.SHORT: 1 if queued else 0, LengthClass.LONG: 0},
                running=running,
                prefix_digest=frozenset(rng.randrange(24) for _ in range(8)),
                prefill_budget_tokens=budget if rng.random() < 0.5 else 0,
            )
        )
    return ClusterView(tuple(workers), tuple(rng.randint(1, 800) for _ in range(50)))


@pytest.mark.parametrize("seed", range(6))
def test_shortcuts_equal_the_replaced_computations(seed: int) -> None:
    rng = random.Random(seed)
    policy = SloGoodput(seed=seed)
    for budget in (0, 0, 512):  # no worker chunks, then some do
        policy.refresh(_view(rng, budget))
        t = policy._table
        assert bool(t.chunk_tokens.any()) == bool(budget)
        for _ in range(20):
            prompt = rng.randint(1, 4000)
            hashes = tuple(rng.randrange(24) for _ in range(rng.randint(0, 6)))
            profile = RequestProfile("r", prompt, prompt, 256, prefix_hashes=hashes)
            n, least = policy._prefill_tokens(profile)
            if hashes:
                assert np.array_equal(n, _reference_prefill_tokens(t, profile))
                capable = t.in_roles((Role.PREFILL, *policy.colocate_roles))
                assert least == n[capable].min()  # what θ observes
            else:
                assert n == least == prompt
            mean = policy._mean_output_len
            got = colocated_tpot_s(t, n, mean)
            assert np.array_equal(got, _reference_colocated_tpot_s(t, n, mean))
