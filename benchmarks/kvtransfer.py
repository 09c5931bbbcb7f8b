"""KV-transfer throughput between two OS processes, beside a memory copy of the same bytes.

For each backend a holder process lends blocks and this process pulls them:
1 MiB, 16 MiB and 256 MiB contiguous (1 MiB blocks, adjacent ids), and a
scattered case (random 16 KiB blocks, 64 MiB in all, random ids on both sides).
The baseline is ``torch`` ``copy_`` of the same number of bytes between two
buffers in this process, measured in the same run (``gather_copy_gbps`` adds an
in-process gather/scatter of the same scattered blocks). Timed: ``pull`` to
``DONE``, including the completion check, median of several runs after a warm-up.

Prints one JSON line per (backend, case):
``{"backend", "size_bytes", "scattered", "gbps", "memcpy_gbps", "ratio", ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtransfer import KVConnector, KVLayout, TransferState, make_connector

MIB = 1 << 20
BIG = KVLayout(num_layers=8, block_size=16, num_kv_heads=4, head_dim=256, dtype="float32")
SMALL = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=32, dtype="float32")
assert BIG.block_bytes == MIB and SMALL.block_bytes == 16 * 1024
REGIONS = {"big": (BIG, 256), "small": (SMALL, 8192)}  # 256 MiB and 128 MiB pools


@dataclass(frozen=True, slots=True)
class Case:
    region: str
    num_blocks: int
    scattered: bool
    repeats: int

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * REGIONS[self.region][0].block_bytes


CASES = [
    Case("big", 1, False, 20),
    Case("big", 16, False, 10),
    Case("big", 256, False, 4),
    Case("small", 4096, True, 4),  # 64 MiB of random 16 KiB blocks
]


def _pools(device: str) -> dict[str, torch.Tensor]:
    return {
        name: torch.ones((n, *layout.block_shape), device=device)
        for name, (layout, n) in REGIONS.items()
    }


def _holder(backend: str, device: str, pipe: Any) -> None:
    torch.set_num_threads(1)
    conn = make_connector(backend, lease_s=60.0, transfer_timeout_s=60.0)
    pools = _pools(device)
    for name, pool in pools.items():
        conn.register(name, pool, REGIONS[name][0])
    pipe.send("ready")
    while True:
        if pipe.poll(0.002):  # the holder is idle during a READ; pulls never wait on it
            msg = pipe.recv()
            if msg is None:
                conn.close()
                return
            region, block_ids = msg
            pipe.send(conn.hold(region, block_ids))
        conn.progress()


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pull_s(conn: KVConnector, pipe: Any, case: Case, rng: random.Random) -> float:
    n_region = REGIONS[case.region][1]
    times = []
    for i in range(case.repeats + 1):
        if case.scattered:
            held = rng.sample(range(n_region), case.num_blocks)
            local = rng.sample(range(n_region), case.num_blocks)
        else:
            held = local = list(range(case.num_blocks))
        pipe.send((case.region, held))
        handle = pipe.recv()
        start = time.perf_counter()
        tid = conn.pull(handle, case.region, local)
        while not (state := conn.poll(tid)).is_final:
            pass
        elapsed = time.perf_counter() - start
        if state is not TransferState.DONE:
            raise RuntimeError(f"{conn.name} pull failed: {case}")
        if i > 0:  # the first pull also connects to the peer
            times.append(elapsed)
    return statistics.median(times)


def _baseline_s(case: Case, device: str, rng: random.Random) -> tuple[float, float]:
    nbytes = case.size_bytes
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()

    memcpy_s = _median_s(copy, case.repeats)
    if not case.scattered:
        return memcpy_s, memcpy_s
    layout, n_region = REGIONS[case.region]
    pool_a = torch.ones((n_region, *layout.block_shape), device=device)
    pool_b = torch.empty_like(pool_a)
    held = torch.tensor(rng.sample(range(n_region), case.num_blocks), device=device)
    local = torch.tensor(rng.sample(range(n_region), case.num_blocks), device=device)

    def gather_scatter() -> None:
        pool_b.index_copy_(0, local, pool_a.index_select(0, held))
        if device == "cuda":
            torch.cuda.synchronize()

    return memcpy_s, _median_s(gather_scatter, case.repeats)


def run_backend(backend: str, device: str) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(backend, device, child), daemon=True)
    proc.start()
    rows = []
    conn = make_connector(backend, lease_s=60.0, transfer_timeout_s=60.0)
    try:
        for name, pool in _pools(device).items():
            conn.register(name, pool, REGIONS[name][0])
        if pipe.recv() != "ready":
            raise RuntimeError("holder did not start")
        rng = random.Random(0)
        for case in CASES:
            pull_s = _pull_s(conn, pipe, case, rng)
            memcpy_s, gather_s = _baseline_s(case, device, rng)
            gbps = case.size_bytes / pull_s / 1e9
            memcpy_gbps = case.size_bytes / memcpy_s / 1e9
            row = {
                "backend": backend,
                "device": device,
                "size_bytes": case.size_bytes,
                "scattered": case.scattered,
                "gbps": round(gbps, 3),
                "memcpy_gbps": round(memcpy_gbps, 3),
                "ratio": round(gbps / memcpy_gbps, 3),
            }
            if case.scattered:
                row["block_bytes"] = REGIONS[case.region][0].block_bytes
                row["gather_copy_gbps"] = round(case.size_bytes / gather_s / 1e9, 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        pipe.send(None)
        proc.join(30)
        conn.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="nixl,torch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.device == "cuda" else ["cpu"]
    for device in devices:
        for backend in args.backends.split(","):
            run_backend(backend, device)


if __name__ == "__main__":
    main()
