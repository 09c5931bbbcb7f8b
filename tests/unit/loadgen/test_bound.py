"""The fluid bound against hand-computed figures."""

from __future__ import annotations

import pytest

from loadgen.sim.bound import fluid_bound
from loadgen.sim.profile import Profile, QuadCoeffs, TransferCoeffs
from loadgen.workload import RequestSpec


def _profile(num_kv_blocks: int = 10_000) -> Profile:
    return Profile(
        model="hand",
        hardware="hand",
        prefill=QuadCoeffs(a=0.0, b=1e-3, c=0.0),  # 1 ms a prompt token
        decode=QuadCoeffs(a=0.01, b=0.001, c=0.0),  # 10 ms + 1 ms a sequence
        transfer=TransferCoeffs(bandwidth_bytes_per_s=1e9, latency_s=0.0),
        kv_bytes_per_token=1,
        num_kv_blocks=num_kv_blocks,
        block_size=16,
        max_num_seqs=64,
    )


# Prefill 0.1 s and 0.3 s; each decodes 10 steps over a mean context of n + 5.5.
SPECS = [RequestSpec("a", 0.0, 100, 11), RequestSpec("b", 0.0, 300, 11)]


def test_split_and_free_bounds() -> None:
    # TPOT 20 ms: B = 10 (10 + 10 ms), 500 tokens/s; 10 tokens a request = 0.02 s.
    split = fluid_bound(_profile(), SPECS, 0.02, 1, 1, attainment=0.5)
    assert split.decode_batch == 10
    assert split.served_all_rps == pytest.approx(min(1 / 0.2, 1 / 0.02))  # prefill-bound: 5
    assert split.random_shed_rps == pytest.approx(5 / 0.5)
    # Leaving the 300-token prompt unserved: prefill 0.1 s a request, 10/s, at 50%: 20/s.
    assert split.costliest_shed_rps == pytest.approx(10 / 0.5)
    free = fluid_bound(_profile(), SPECS, 0.02, 0, 0, gpus=2)
    assert free.served_all_rps == pytest.approx(2 / (0.2 + 0.02))


def test_kv_memory_caps_the_decode_batch() -> None:
    # 100 blocks x 16 = 1600 tokens; mean context 205.5 tokens: 7 sequences fit, not 8.
    bound = fluid_bound(_profile(num_kv_blocks=100), SPECS, 0.02, 1, 1)
    assert bound.decode_batch == 7
    decode_s = 10 / (7 / 0.017)
    assert bound.served_all_rps == pytest.approx(min(1 / 0.2, 1 / decode_s))
