"""KV-transfer throughput between two OS processes, beside a memory copy of the same bytes.

For each backend a holder process lends blocks and this process pulls them:
1 MiB, 16 MiB and 256 MiB contiguous (1 MiB blocks, adjacent ids), and a
scattered case (random 16 KiB blocks, 64 MiB in all, random ids on both sides).
The baseline is ``torch`` ``copy_`` of the same number of bytes between two
buffers in this process, allocated like the pools (``alloc_region``: huge pages
on CPU where Linux allows) and measured in the same run (``gather_copy_gbps`` adds an
in-process gather/scatter of the same scattered blocks). Timed: ``pull`` to
``DONE``, including the completion check; medians of several runs after a
warm-up, each pull followed by its baselines so that load from other processes
on a shared machine hits both alike.

Prints one JSON line per (backend, case):
``{"backend", "size_bytes", "scattered", "gbps", "memcpy_gbps", "ratio", ...}``.
With ``--device cuda`` the holder's blocks live on the second GPU where there is one
(on one GPU both sides share it, and ``torch``, whose NCCL wants a GPU per rank, is
reported as skipped).
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

from kvtransfer import KVConnector, KVLayout, TransferState, alloc_region, make_connector

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
    Case("big", 1, False, 30),
    Case("big", 16, False, 10),
    Case("big", 256, False, 5),
    Case("small", 4096, True, 6),  # 64 MiB of random 16 KiB blocks
]


def _pools(device: str) -> dict[str, torch.Tensor]:
    return {
        name: alloc_region((n, *layout.block_shape), torch.float32, device).fill_(1.0)
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


def _timed_s(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _baselines(case: Case, device: str, rng: random.Random) -> dict[str, Callable[[], None]]:
    """In-process copies of the same bytes: plain copy_, and (scattered) gather/scatter."""

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            if device == "cuda":
                torch.cuda.synchronize()

        return run

    # same allocation as the transfer pools, so both sides get the same page size
    src = alloc_region((case.size_bytes // 4,), torch.float32, device).fill_(1.0)
    dst = alloc_region((case.size_bytes // 4,), torch.float32, device)
    fns = {"memcpy": synced(lambda: dst.copy_(src))}
    if case.scattered:
        layout, n_region = REGIONS[case.region]
        pool_a = alloc_region((n_region, *layout.block_shape), torch.float32, device)
        pool_b = alloc_region((n_region, *layout.block_shape), torch.float32, device)
        held = torch.tensor(rng.sample(range(n_region), case.num_blocks), device=device)
        local = torch.tensor(rng.sample(range(n_region), case.num_blocks), device=device)
        fns["gather_copy"] = synced(
            lambda: pool_b.index_copy_(0, local, pool_a.index_select(0, held))
        )
    return fns


def _measure(
    conn: KVConnector, pipe: Any, case: Case, device: str, rng: random.Random
) -> dict[str, float]:
    """Median seconds of the pull and of each baseline, interleaved run by run so that
    load from other processes on a shared machine hits both alike."""
    n_region = REGIONS[case.region][1]
    baselines = _baselines(case, device, rng)
    times: dict[str, list[float]] = {"pull": [], **{name: [] for name in baselines}}
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
        baseline_s = {name: _timed_s(fn) for name, fn in baselines.items()}
        if i == 0:
            continue  # warm-up: the first pull also connects to the peer
        times["pull"].append(elapsed)
        for name, t in baseline_s.items():
            times[name].append(t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_backend(backend: str, device: str) -> list[dict[str, Any]]:
    holder_device = device  # on CUDA: the second GPU where there is one
    if device == "cuda" and torch.cuda.device_count() > 1:
        holder_device = "cuda:1"
    elif device == "cuda" and backend == "torch":  # NCCL: "Duplicate GPU detected"
        why = "NCCL needs a GPU per rank: the holder and the puller need 2 GPUs"
        print(json.dumps({"backend": backend, "device": device, "skipped": why}), flush=True)
        return []
    ctx = mp.get_context("spawn")
    pipe, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(backend, holder_device, child), daemon=True)
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
            median_s = _measure(conn, pipe, case, device, rng)
            gbps = case.size_bytes / median_s["pull"] / 1e9
            memcpy_gbps = case.size_bytes / median_s["memcpy"] / 1e9
            row = {
                "backend": backend,
                "device": device,
                "size_bytes": case.size_bytes,
                "scattered": case.scattered,
                "gbps": round(gbps, 3),
                "memcpy_gbps": round(memcpy_gbps, 3),
                "ratio": round(gbps / memcpy_gbps, 3),
                "pull_ms": round(median_s["pull"] * 1e3, 3),
            }
            if case.scattered:
                row["block_bytes"] = REGIONS[case.region][0].block_bytes
                row["gather_copy_gbps"] = round(case.size_bytes / median_s["gather_copy"] / 1e9, 3)
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
