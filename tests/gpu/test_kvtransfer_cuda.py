"""CUDA paths of the KV-transfer backends: NCCL (torch) and NIXL VRAM, between two processes.

Skipped without CUDA (``gpu`` marker). Same checks as the CPU contract: random
block subsets arrive bit-exact in device memory, and a large pull stays intact.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvtransfer import KVLayout, TransferState, available_backends, make_connector
from tests.contract.kv_holder import REGION, HolderProcess, HolderSpec, expected_blocks, same_bits

pytestmark = pytest.mark.gpu

LAYOUT = KVLayout(
    num_layers=8, block_size=16, num_kv_heads=4, head_dim=128, dtype="float16", device="cuda"
)


@pytest.mark.parametrize("backend", ["nixl", "torch"])
def test_device_blocks_arrive_bit_exact(backend: str) -> None:
    if backend not in available_backends():
        pytest.skip(f"backend {backend} is not installed")
    holder_device = "cuda"
    if backend == "torch":  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected")
        if torch.cuda.device_count() < 2:
            pytest.skip("NCCL needs a GPU per rank: the holder and the puller need 2 GPUs")
        holder_device = "cuda:1"
    holder = HolderProcess(HolderSpec(backend, LAYOUT, 128, seed=5, device=holder_device))
    conn = make_connector(backend, transfer_timeout_s=30.0)
    try:
        pool = torch.zeros((128, *LAYOUT.block_shape), dtype=torch.float16, device="cuda")
        conn.register(REGION, pool, LAYOUT)
        rng = random.Random(3)
        for n in (3, 64, 128):
            held = rng.sample(range(128), n)
            local = rng.sample(range(128), n)
            handle = holder.hold(held)
            tid = conn.pull(handle, REGION, local)
            deadline = time.monotonic() + 30.0
            while not (state := conn.poll(tid)).is_final and time.monotonic() < deadline:
                conn.progress()
            assert state is TransferState.DONE
            torch.cuda.synchronize()
            assert same_bits(pool[local], expected_blocks(LAYOUT, 5, held))
            assert holder.wait_released(handle.transfer_id) == [held]
    finally:
        conn.close()
        holder.stop()
