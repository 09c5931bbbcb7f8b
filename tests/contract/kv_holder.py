"""A holder in its own OS process, driven over a pipe by a test in the parent.

The child owns a connector with one registered region whose blocks hold a
deterministic pattern (a function of seed and block id), so the parent can check
any subset it pulls without copying the holder's pool.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer import make_connector
from kvtransfer.types import BlockHandle, KVLayout

REGION = "kv"


def fill_block(block: torch.Tensor, seed: int, block_id: int) -> None:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + block_id)
    bits = block.view(-1).view(torch.int32)
    bits.copy_(torch.randint(-(2**31), 2**31 - 1, bits.shape, generator=gen, dtype=torch.int32))


def make_pool(spec: HolderSpec) -> torch.Tensor:
    dtype = getattr(torch, spec.layout.dtype)
    pool = torch.empty((spec.num_blocks, *spec.layout.block_shape), dtype=dtype)
    for b in range(spec.num_blocks):
        fill_block(pool[b], spec.seed, b)
    return pool.to(spec.device)


def expected_blocks(layout: KVLayout, seed: int, block_ids: list[int]) -> torch.Tensor:
    out = torch.empty((len(block_ids), *layout.block_shape), dtype=getattr(torch, layout.dtype))
    for i, b in enumerate(block_ids):
        fill_block(out[i], seed, b)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@dataclass(frozen=True, slots=True)
class HolderSpec:
    backend: str
    layout: KVLayout
    num_blocks: int
    seed: int = 0
    lease_s: float = 30.0
    transfer_timeout_s: float = 5.0
    device: str = "cpu"


def _serve(spec: HolderSpec, pipe: Any) -> None:
    torch.set_num_threads(1)
    conn = make_connector(
        spec.backend, lease_s=spec.lease_s, transfer_timeout_s=spec.transfer_timeout_s
    )
    pool = make_pool(spec)
    conn.register(REGION, pool, spec.layout)
    pipe.send(("ready", conn.agent_name))

    def report_release(tid_box: list[str], block_ids: Any) -> None:
        pipe.send(("released", tid_box[0], list(block_ids)))

    while True:
        if pipe.poll(0.0005):
            match pipe.recv():
                case ("hold", list(block_ids), lease_s):
                    box: list[str] = []
                    handle = conn.hold(
                        REGION,
                        block_ids,
                        lease_s=lease_s,
                        on_release=lambda ids, box=box: report_release(box, ids),
                    )
                    box.append(handle.transfer_id)
                    pipe.send(("handle", handle))
                case ("release", str(tid)):
                    conn.release(tid)
                    pipe.send(("ok", tid))
                case ("stop",):
                    conn.close()
                    pipe.send(("stopped",))
                    return
        conn.progress()


class HolderProcess:
    """Parent-side proxy: commands get replies; release events are collected."""

    def __init__(self, spec: HolderSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self._pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        self.process.start()
        self.released: dict[str, list[list[int]]] = {}
        self.agent_name = self._expect("ready", timeout_s=60.0)[1]

    def hold(self, block_ids: list[int], lease_s: float | None = None) -> BlockHandle:
        self._pipe.send(("hold", block_ids, lease_s))
        handle: BlockHandle = self._expect("handle")[1]
        return handle

    def release(self, transfer_id: str) -> None:
        self._pipe.send(("release", transfer_id))
        self._expect("ok")

    def wait_released(self, transfer_id: str, timeout_s: float = 10.0) -> list[list[int]]:
        deadline = time.monotonic() + timeout_s
        while transfer_id not in self.released and time.monotonic() < deadline:
            self._drain(0.01)
        return self.released.get(transfer_id, [])

    def settle(self, duration_s: float) -> None:
        """Collect events for a while (to see that no second release arrives)."""
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            self._drain(0.01)

    def progress(self) -> None:
        """The child process drives its own progress loop."""

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)

    def stop(self) -> None:
        if self.process.is_alive():
            self._pipe.send(("stop",))
            self._expect("stopped")
            self.process.join(10)
        if self.process.is_alive():
            self.kill()

    def _drain(self, timeout_s: float) -> tuple[Any, ...] | None:
        if not self._pipe.poll(timeout_s):
            return None
        msg = self._pipe.recv()
        if msg[0] == "released":
            self.released.setdefault(msg[1], []).append(msg[2])
            return None
        return tuple(msg)

    def _expect(self, kind: str, timeout_s: float = 30.0) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.is_alive():
                raise RuntimeError(f"holder process died (exit {self.process.exitcode})")
            msg = self._drain(0.05)
            if msg is not None:
                if msg[0] != kind:
                    raise RuntimeError(f"expected {kind!r}, got {msg!r}")
                return msg
        raise TimeoutError(f"no {kind!r} from the holder within {timeout_s} s")


class InProcessHolder:
    """The same interface as HolderProcess for the in-process ``local`` backend."""

    def __init__(self, spec: HolderSpec) -> None:
        self.spec = spec
        self.conn = make_connector(
            spec.backend, lease_s=spec.lease_s, transfer_timeout_s=spec.transfer_timeout_s
        )
        self.pool = make_pool(spec)
        self.conn.register(REGION, self.pool, spec.layout)
        self.agent_name = self.conn.agent_name
        self.released: dict[str, list[list[int]]] = {}

    def hold(self, block_ids: list[int], lease_s: float | None = None) -> BlockHandle:
        box: list[str] = []

        def on_release(ids: Any) -> None:
            self.released.setdefault(box[0], []).append(list(ids))

        handle = self.conn.hold(REGION, block_ids, lease_s=lease_s, on_release=on_release)
        box.append(handle.transfer_id)
        return handle

    def release(self, transfer_id: str) -> None:
        self.conn.release(transfer_id)

    def wait_released(self, transfer_id: str, timeout_s: float = 10.0) -> list[list[int]]:
        deadline = time.monotonic() + timeout_s
        while transfer_id not in self.released and time.monotonic() < deadline:
            self.conn.progress()
            time.sleep(0.001)
        return self.released.get(transfer_id, [])

    def settle(self, duration_s: float) -> None:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            self.conn.progress()
            time.sleep(0.005)

    def progress(self) -> None:
        self.conn.progress()

    def stop(self) -> None:
        self.conn.close()


def start_holder(spec: HolderSpec) -> HolderProcess | InProcessHolder:
    """``local`` runs in this process; every other backend in a spawned OS process."""
    return InProcessHolder(spec) if spec.backend == "local" else HolderProcess(spec)
