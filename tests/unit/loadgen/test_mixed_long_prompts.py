"""Long prompts on a cluster of mixed workers (the prefill-heavy thirds of
``benchmarks/policies.py``'s phase shift, every worker mixed), simulated through
``slo_goodput``: each worker's cost model is fitted online from its own steps, chunks
of about its 512-token budget, and must still price a whole long prompt sensibly."""

from __future__ import annotations

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO
from loadgen.scenario import WorkloadConfig
from loadgen.sim import SimConfig, simulate
from loadgen.sim.profile import load_profile
from router.front_door import RouterSettings
from router.types import Role


def test_long_prompts_on_mixed_workers_are_not_herded_onto_one() -> None:
    # 16 mixed H100s, prompts of 1500-3000 tokens at 150 req/s (round_robin serves it
    # all within the SLOs). Fitted freely, a worker's prefill curve priced a 2250-token
    # prompt below zero, every long prompt went to it and TTFT reached seconds:
    # attainment 0.18; and its queue of chunked prompts was priced one step a prompt.
    profile = load_profile("llama3-8b-h100")
    config = SimConfig(
        workload=WorkloadConfig(
            input_len="uniform:1500-3000", output_len="uniform:8-32", num_requests=600, seed=0
        ),
        rate=RateSpec(150.0),
        num_colocated=16,
        router=RouterSettings(
            profile=profile, length_split="temporal", colocate_roles=(Role.MIXED,)
        ),
        policy="slo_goodput",
        profile=profile,
        slo=GoodputSLO(ttft_ms=500, tpot_ms=25),
        max_tokens=1024,
        rebalance=False,
    )
    summary = simulate(config).summary
    assert summary["slo_attainment"] >= 0.95
