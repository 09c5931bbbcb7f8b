"""C++ kernels for the CPU hot path (``csrc/``): built once, chosen once.

* ``paged_decode``: decode attention (one query token per sequence). The pure-torch
  path (``attention.py``) first gathers every sequence's whole blocks into one padded
  copy, then runs two small batched products and a softmax: the gather and the badly
  shaped products were about a fifth of a decode step of the ~76M Llama on a CPU. The
  kernel reads K and V straight from the pool through the block table, per (sequence,
  kv head) in parallel (``at::parallel_for``), every query head of a grouped-query
  group against each key row while it is in cache, with an exact softmax.
* ``paged_prefill_``: attention of many query tokens per sequence (whole prompts and
  chunks after a cached prefix), also straight from the pool, flash-attention style:
  per (sequence, kv head, up to 384 query rows), key tiles of 32 tokens copied into
  float32 scratch, scores, an online softmax (an inline polynomial exp) and the weighted
  values in registers, rows skipped where the causal or sliding-window mask hides the
  whole tile. SDPA on padded prompts took 10.6 ms a layer for 16 prompts of 128 tokens
  (12 heads, 4 KV heads, head_dim 64, one AVX-512 thread); this takes 4.1 ms (vLLM's
  CPU attention: 4.4 ms). Head dims 16, 32, 64 and 128; others keep the torch path.
* ``rms_norm``: one pass per row where ``model.rms_norm`` runs six ops.
* ``rotary_write_``: RoPE on q and k in place and this step's K/V written into the
  pool at their slots, where the torch path runs a roll, two products, a stack and
  an ``index_copy_`` per layer.

float32 and bfloat16, float32 accumulation. Compiled with the host's g++ as a torch
C++ extension the first time a process asks (``torch.utils.cpp_extension.load``,
about 10 s, logged), into a cache folder keyed by the sources, the flags, torch's
version and this CPU's instruction sets (the code is built for the host:
``-march=native``); every later load is a check and a ``dlopen``. Where they cannot
be built (no compiler), or the model is not on a CPU, the engine keeps the torch path:
``select_cpu_kernels`` says which in one log line, and ``EngineStats.kernels`` too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_BUILD_ROOT",
    "PREFILL_KERNEL_HEAD_DIMS",
    "TORCH_KERNELS",
    "CpuKernels",
    "build_cpu_kernels",
    "select_cpu_kernels",
]

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = tuple(
    _CSRC / name for name in ("cpu_kernels.cpp", "paged_decode.cpp", "paged_prefill.cpp")
)
_HEADERS = (_CSRC / "kernels.h",)
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17")
# Shared by every process of a user (tests, CI, workers): compiled once per machine kind.
DEFAULT_BUILD_ROOT = Path.home() / ".cache" / "baton" / "torch_extensions"
TORCH_KERNELS = "torch"  # the name of the fallback in logs and stats
PREFILL_KERNEL_HEAD_DIMS = frozenset({16, 32, 64, 128})  # paged_prefill_'s; others: torch
_STALE_LOCK_S = 300.0  # a build takes ~10 s


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """The ops of ``torch.ops.baton`` (loaded by ``build_cpu_kernels``)."""

    name: str = "cpp"

    def paged_decode(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """q [S, heads, d], kv the whole pool, block_tables [S, blocks] and context_lens [S]
        int64 -> [S, heads * d]: each query over its sequence's first ``context_lens`` keys
        (the last ``sliding_window`` of them, if set)."""
        op = torch.ops.baton.paged_decode
        return op(q, kv, layer, block_tables, context_lens, scale, sliding_window or 0)

    def paged_prefill_(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of many queries per sequence, into ``out`` [T, heads * d]:
        sequence ``s``'s queries are q [T, heads, d] rows ``query_starts[s]`` onwards, the
        last ``query_lens[s]`` of its ``context_lens[s]`` positions (their K/V already in
        the pool); each sees the keys at or before its position (the last
        ``sliding_window`` of them, if set). Tables and lengths int64, one row per sequence."""
        op = torch.ops.baton.paged_prefill_
        op(
            q, kv, layer, block_tables, query_starts, query_lens, context_lens, scale,
            sliding_window or 0, out,
        )  # fmt: skip

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``model.rms_norm`` for a contiguous ``x``."""
        return torch.ops.baton.rms_norm(x, weight, eps)

    def rotary_write_(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
    ) -> None:
        """``apply_rotary`` on qk [T, heads + kv_heads, d] in place (rows may be strided),
        then the rotated k (its last kv_heads) and v [T, kv_heads, d] stored at ``slots``
        [T] of ``layer`` in the pool; cos / signed_sin as ``RotaryEmbedding.cos_sin`` gives."""
        torch.ops.baton.rotary_write_(qk, v, cos, signed_sin, kv, layer, slots)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_dir(root: Path) -> Path:
    code = "\n".join(path.read_text() for path in (*_SOURCES, *_HEADERS))
    key = "\n".join((code, " ".join(_CFLAGS), torch.__version__, _cpu_flags()))
    return root / f"cpu_kernels_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@functools.cache
def build_cpu_kernels(build_root: Path = DEFAULT_BUILD_ROOT) -> CpuKernels:
    """Compile (first time on this machine) and load the kernels; raise if they cannot be built.

    Cached per process: the library registers ``torch.ops.baton`` once."""
    from torch.utils import cpp_extension

    build_dir = _build_dir(build_root)
    build_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension makes a concurrent builder wait on this file; one left by a builder
    # that was killed would make every later engine start wait forever.
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            log.warning("removing a stale build lock %s", lock)
            lock.unlink()
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.warning("building the CPU C++ kernels into %s (once, ~10 s)", build_dir)
    started = time.perf_counter()
    cpp_extension.load(
        name="baton_cpu_kernels",
        sources=[str(path) for path in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        log.warning("built the CPU C++ kernels in %.1f s", time.perf_counter() - started)
    return CpuKernels()


def select_cpu_kernels(
    device: torch.device, *, enabled: bool = True, build_root: Path = DEFAULT_BUILD_ROOT
) -> CpuKernels | None:
    """The kernels for a model on ``device``, or None for the torch path (logged either way)."""
    if not enabled or device.type != "cpu":
        why = "turned off" if not enabled else f"the model is on {device.type}"
        log.info("engine kernels: %s (%s)", TORCH_KERNELS, why)
        return None
    try:
        kernels = build_cpu_kernels(build_root)
    except Exception as e:  # no compiler, a failed build or load: the torch path still works
        log.warning("engine kernels: %s (the C++ kernels did not build: %s)", TORCH_KERNELS, e)
        return None
    log.info(
        "engine kernels: %s (decode and prefill attention, RMSNorm, rotary + KV write)",
        kernels.name,
    )
    return kernels


def main() -> None:
    """``python -m services.engine.cpu_kernels``: build the kernels now (``make test`` does);
    where they cannot build, say so and succeed (engines then run the torch ops)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    kernels = select_cpu_kernels(torch.device("cpu"))
    where = _build_dir(DEFAULT_BUILD_ROOT)
    status = "ready in" if kernels is not None else "not built; engines use torch ops, see"
    print(f"CPU C++ kernels {status} {where} ({time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
