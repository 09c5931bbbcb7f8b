"""KVConnector contract, run against every backend.

``local`` holds in this process; ``nixl`` and ``torch`` hold in a second, spawned
OS process (``tests/contract/kv_holder.py``), so every byte checked here crossed
a process boundary. Adding a backend is one line in ``BACKENDS``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtransfer import (
    KVConnector,
    KVLayout,
    LayoutMismatchError,
    ReportsOpenTransfers,
    TransferState,
    UnknownHandleError,
    available_backends,
    make_connector,
)
from tests.contract.kv_holder import (
    REGION,
    HolderProcess,
    HolderSpec,
    InProcessHolder,
    expected_blocks,
    same_bits,
    start_holder,
)

BACKENDS = [
    pytest.param("local"),
    pytest.param("nixl"),
    pytest.param("torch"),
]

SMALL = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
# 1 MiB per block: 8 layers x K/V x 4 heads x 16 tokens x 256 dims x 4 bytes
BIG = KVLayout(num_layers=8, block_size=16, num_kv_heads=4, head_dim=256, dtype="float32")
HOLDER_BLOCKS = 96
PULLER_BLOCKS = 64
TIMEOUT_S = 10.0  # generous: the CI box is shared, and a pull that hangs still ends in it
KILL_TIMEOUT_S = 3.0  # the one test that waits for a timeout to fire
SEED = 7

Holder = HolderProcess | InProcessHolder


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name not in available_backends():
        pytest.skip(f"backend {name} is not installed")
    return name


@pytest.fixture(scope="module")
def holder(backend: str) -> Iterator[Holder]:
    h = start_holder(
        HolderSpec(backend, SMALL, HOLDER_BLOCKS, seed=SEED, transfer_timeout_s=TIMEOUT_S)
    )
    yield h
    h.stop()


@pytest.fixture
def puller(backend: str) -> Iterator[tuple[KVConnector, torch.Tensor]]:
    torch.set_num_threads(1)
    conn = make_connector(backend, transfer_timeout_s=TIMEOUT_S)
    pool = torch.full((PULLER_BLOCKS, *SMALL.block_shape), -1.0)
    conn.register(REGION, pool, SMALL)
    yield conn, pool
    conn.close()


def wait_final(conn: KVConnector, tid: str, holder: Holder, timeout_s: float) -> TransferState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = conn.poll(tid)
        if state.is_final or time.monotonic() > deadline:
            return state
        holder.progress()
        conn.progress()


def pull_outcome(conn: KVConnector, handle: Any, ids: list[int], holder: Holder) -> str:
    """'refused' (raised locally), or the final state's value ('failed', 'done')."""
    try:
        tid = conn.pull(handle, REGION, ids)
    except UnknownHandleError:
        return "refused"
    return wait_final(conn, tid, holder, TIMEOUT_S + 2.0).value


def test_random_subsets_arrive_bit_exact(holder: Holder, puller: Any, backend: str) -> None:
    conn, pool = puller
    assert isinstance(conn, ReportsOpenTransfers)
    rng = random.Random(1)
    for n in (1, 5, 17):
        held = rng.sample(range(HOLDER_BLOCKS), n)
        local = rng.sample(range(PULLER_BLOCKS), n)
        before = pool.clone()
        handle = holder.hold(held)
        assert handle.backend == backend and handle.block_ids == tuple(held)
        tid = conn.pull(handle, REGION, local)
        assert wait_final(conn, tid, holder, TIMEOUT_S) is TransferState.DONE
        assert same_bits(pool[local], expected_blocks(SMALL, SEED, held))
        untouched = sorted(set(range(PULLER_BLOCKS)) - set(local))
        assert same_bits(pool[untouched], before[untouched])
        # completion reaches the holder, which frees exactly the held blocks, once
        assert holder.wait_released(handle.transfer_id) == [held]
    assert conn.num_open_transfers() == 0


def test_interleaved_transfers_land_in_their_own_blocks(holder: Holder, puller: Any) -> None:
    conn, pool = puller
    rng = random.Random(2)
    held_sets = [rng.sample(range(HOLDER_BLOCKS), 6) for _ in range(4)]
    local_all = rng.sample(range(PULLER_BLOCKS), 24)
    local_sets = [local_all[i * 6 : (i + 1) * 6] for i in range(4)]
    handles = [holder.hold(h) for h in held_sets]
    tids = [conn.pull(h, REGION, ids) for h, ids in zip(handles, local_sets)]
    assert len(set(tids)) == 4
    for tid in reversed(tids):
        assert wait_final(conn, tid, holder, TIMEOUT_S) is TransferState.DONE
    for held, local in zip(held_sets, local_sets):
        assert same_bits(pool[local], expected_blocks(SMALL, SEED, held))
    for handle, held in zip(handles, held_sets):
        assert holder.wait_released(handle.transfer_id) == [held]


def test_layout_mismatch_is_refused_before_bytes_move(holder: Holder, backend: str) -> None:
    other = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=16, dtype="float16")
    conn = make_connector(backend, transfer_timeout_s=TIMEOUT_S)
    wrong = torch.zeros((8, *other.block_shape), dtype=torch.float16)
    right = torch.zeros((8, *SMALL.block_shape))
    conn.register("wrong", wrong, other)
    conn.register(REGION, right, SMALL)
    try:
        handle = holder.hold([3, 4])
        with pytest.raises(LayoutMismatchError, match=r"dtype.*head_dim|head_dim.*dtype") as err:
            conn.pull(handle, "wrong", [0, 1])
        assert "block_size" not in str(err.value)
        assert not wrong.any() and conn.num_open_transfers() == 0
        # the hold is untouched: a compatible pull of the same handle still succeeds
        holder.settle(0.05)
        assert handle.transfer_id not in holder.released
        tid = conn.pull(handle, REGION, [5, 6])
        assert wait_final(conn, tid, holder, TIMEOUT_S) is TransferState.DONE
        assert same_bits(right[[5, 6]], expected_blocks(SMALL, SEED, [3, 4]))
    finally:
        conn.close()


def test_release_twice_fires_callback_once_and_refuses_pulls(holder: Holder, puller: Any) -> None:
    conn, pool = puller
    handle = holder.hold([10, 11, 12])
    holder.release(handle.transfer_id)
    holder.release(handle.transfer_id)
    holder.settle(0.2)
    assert holder.released[handle.transfer_id] == [[10, 11, 12]]
    before = pool.clone()
    assert pull_outcome(conn, handle, [0, 1, 2], holder) in ("refused", "failed")
    assert conn.num_open_transfers() == 0
    # a refused pull may have touched only the puller's own target blocks
    assert same_bits(pool[3:], before[3:])
    # releasing after a completed pull does not fire the callback again
    done = holder.hold([20])
    tid = conn.pull(done, REGION, [9])
    assert wait_final(conn, tid, holder, TIMEOUT_S) is TransferState.DONE
    holder.wait_released(done.transfer_id)
    holder.release(done.transfer_id)
    holder.settle(0.2)
    assert holder.released[done.transfer_id] == [[20]]


def test_unclaimed_hold_expires_and_is_refused(holder: Holder, puller: Any) -> None:
    conn, _ = puller
    start = time.monotonic()
    handle = holder.hold([30, 31], lease_s=0.3)
    assert holder.wait_released(handle.transfer_id, timeout_s=5.0) == [[30, 31]]
    assert 0.25 <= time.monotonic() - start < 3.0
    assert pull_outcome(conn, handle, [0, 1], holder) in ("refused", "failed")
    holder.settle(0.1)
    assert holder.released[handle.transfer_id] == [[30, 31]]


def test_unknown_handle_is_refused(holder: Holder, puller: Any, backend: str) -> None:
    conn, _ = puller
    real = holder.hold([40])
    forged = type(real)(
        backend=real.backend,
        agent=real.agent,
        region=real.region,
        transfer_id="no-such-transfer",
        block_ids=real.block_ids,
        layout=real.layout,
        expires_at_s=real.expires_at_s,
        peer_info=real.peer_info.replace(b'"generation":', b'"generation":9'),
    )
    outcome = pull_outcome(conn, forged, [0], holder)
    assert outcome == "refused" if backend == "local" else outcome in ("refused", "failed")
    holder.release(real.transfer_id)


def test_large_transfer_arrives_intact(backend: str) -> None:
    num_blocks = 256  # 256 MiB
    holder = start_holder(HolderSpec(backend, BIG, num_blocks + 8, seed=11, transfer_timeout_s=30))
    conn = make_connector(backend, transfer_timeout_s=30.0)
    try:
        pool = torch.zeros((num_blocks, *BIG.block_shape))
        conn.register(REGION, pool, BIG)
        held = list(range(4, 4 + num_blocks))
        handle = holder.hold(held)
        tid = conn.pull(handle, REGION, list(range(num_blocks)))
        assert wait_final(conn, tid, holder, 30.0) is TransferState.DONE
        for start in range(0, num_blocks, 32):
            chunk = held[start : start + 32]
            assert same_bits(pool[start : start + 32], expected_blocks(BIG, 11, chunk))
        assert holder.wait_released(handle.transfer_id) == [held]
    finally:
        conn.close()
        holder.stop()


def test_holder_killed_mid_transfer_fails_within_timeout(backend: str) -> None:
    if backend == "local":
        pytest.skip("local pulls are synchronous copies; there is no holder process to kill")
    holder = HolderProcess(HolderSpec(backend, BIG, 64, seed=3, transfer_timeout_s=KILL_TIMEOUT_S))
    conn = make_connector(backend, transfer_timeout_s=KILL_TIMEOUT_S)
    try:
        pool = torch.zeros((64, *BIG.block_shape))
        conn.register(REGION, pool, BIG)
        handle = holder.hold(list(range(64)))
        tid = conn.pull(handle, REGION, list(range(64)))
        start = time.monotonic()
        holder.kill()
        assert wait_final(conn, tid, holder, KILL_TIMEOUT_S + 5.0) is TransferState.FAILED
        assert time.monotonic() - start <= KILL_TIMEOUT_S + 1.0
        # nothing stays allocated on the puller once its threads have unwound
        deadline = time.monotonic() + KILL_TIMEOUT_S + 2.0
        while conn.num_open_transfers() and time.monotonic() < deadline:
            conn.progress()
            time.sleep(0.05)
        assert conn.num_open_transfers() == 0
    finally:
        conn.close()
        holder.stop()
