"""Small constructors for router tests: a round-numbered profile, workers, requests."""

from __future__ import annotations

import math
from typing import Any

from router import make_policy
from router.policies import SloGoodput
from router.profile import EncodeCoeffs, Profile, QuadCoeffs, TransferCoeffs
from router.types import (
    SLO,
    ClusterView,
    LengthClass,
    Plan,
    Priority,
    Reject,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
    WorkerView,
)

# prefill(n) = 0.01 + 1e-4·n; step(B, L) = 0.01 + 1e-4·B + 1e-7·L;
# 1000 prompt tokens of KV = 1e8 bytes = 0.1 s on a 1 GB/s link (+1 ms).
PROFILE = Profile(
    model="test",
    hardware="test",
    prefill=QuadCoeffs(0.01, 1e-4, 0.0),
    decode=QuadCoeffs(0.01, 1e-4, 1e-7),
    transfer=TransferCoeffs(bandwidth_bytes_per_s=1e9, latency_s=0.001),
    kv_bytes_per_token=100_000,
    num_kv_blocks=1000,
    block_size=16,
    max_num_seqs=64,
    encode=EncodeCoeffs(a=0.005, b=1e-5),
)
OUTPUT_LEN = 100  # every finished request generated this many tokens
SLO_DEFAULT = SLO(ttft_s=1.0, tpot_s=0.02)


def prefill_s(n: int) -> float:
    return 0.01 + 1e-4 * n


def worker(
    worker_id: str,
    role: Role,
    running: tuple[RunningRequest, ...] = (),
    total_blocks: int = 1000,
    short_tokens: int = 0,
    short_requests: int = 0,
    long_tokens: int = 0,
    long_requests: int = 0,
    bandwidth: float = 1e9,
    digest: frozenset[int] = frozenset(),
    steps: tuple[StepSample, ...] = (),
    alive: bool = True,
    draining: bool = False,
    max_num_seqs: int = 64,
    long_prefill_tokens: int = 0,
) -> WorkerView:
    held = sum(r.num_tokens_held for r in running)
    return WorkerView(
        worker_id=worker_id,
        role=role,
        alive=alive,
        draining=draining,
        num_total_blocks=total_blocks,
        num_free_blocks=total_blocks - math.ceil(held / 16),
        block_size=16,
        queued_tokens={LengthClass.SHORT: short_tokens, LengthClass.LONG: long_tokens},
        queued_requests={LengthClass.SHORT: short_requests, LengthClass.LONG: long_requests},
        running=running,
        recent_steps=steps,
        prefix_digest=digest,
        link_bandwidth_bytes_per_s=bandwidth,
        kv_bytes_per_token=100_000,
        max_num_seqs=max_num_seqs,
        long_prefill_tokens=long_prefill_tokens,
    )


def busy(count: int, held: int, generated: int = 0, max_tokens: int = 1000):
    return tuple(RunningRequest(held, generated, max_tokens) for _ in range(count))


def view(*workers: WorkerView) -> ClusterView:
    return ClusterView(workers=tuple(workers))


def request(
    prompt: int = 500,
    max_tokens: int = 1000,
    priority: Priority = Priority.INTERACTIVE,
    arrival_s: float = 0.0,
    prefix_hashes: tuple[int, ...] = (),
    image_tokens: int = 0,
    new_tokens: int | None = None,
) -> RequestProfile:
    return RequestProfile(
        request_id="r",
        num_prompt_tokens=prompt,
        num_new_tokens=prompt if new_tokens is None else new_tokens,
        max_tokens=max_tokens,
        num_image_tokens=image_tokens,
        priority=priority,
        prefix_hashes=prefix_hashes,
        arrival_s=arrival_s,
    )


def policy(**options: Any) -> SloGoodput:
    """slo_goodput on ``PROFILE`` with a one-length history, disaggregated only by default."""
    settings = {
        "profile": PROFILE,
        "prior_output_len": OUTPUT_LEN,
        "default_slo": SLO_DEFAULT,
        "colocate_roles": (),
    }
    settings.update(options)
    built = make_policy("slo_goodput", **settings)
    assert isinstance(built, SloGoodput)
    return built


def plan_of(result: Plan | Reject) -> Plan:
    """The plan a policy returned (fails the test on a refusal or a hold)."""
    assert isinstance(result, Plan), result
    return result


class FakePredictingPolicy:
    """Plans p -> d with fixed predictions, as ``slo_goodput`` would (a fake: tests only)."""

    def __init__(self, ttft_s: float | None = 0.5, tpot_s: float | None = 0.05) -> None:
        self.ttft_s, self.tpot_s = ttft_s, tpot_s

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan:
        return Plan("p", "d", predicted_ttft_s=self.ttft_s, predicted_tpot_s=self.tpot_s)
