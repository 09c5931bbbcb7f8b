"""The CPU decode-attention kernel (``csrc/paged_decode.cpp``): built once, chosen once.

At decode each sequence has one query token. The pure-torch path (``attention.py``)
first gathers every sequence's whole blocks into one padded copy, then runs two
small batched products and a softmax: the gather and the badly shaped products were
about a fifth of a decode step of the ~76M Llama on a CPU. The kernel reads K and V
straight from the pool through the block table, per (sequence, kv head) in parallel
(``at::parallel_for``), every query head of a grouped-query group against each key
row while it is in cache, with an exact softmax; float32 and bfloat16.

It is compiled with the host's g++ as a torch C++ extension the first time a process
asks for it (``torch.utils.cpp_extension.load``, about 8 s, logged), into a cache
folder keyed by the source, the compiler flags, torch's version and this CPU's
instruction sets (the code is built for the host: ``-march=native``); every later
load is a check and a ``dlopen``. Where it cannot be built (no compiler, a CUDA
model) the engine keeps the torch path; ``select_decode_kernel`` says which in one
log line, and the engine reports it in ``EngineStats.decode_attention``.
"""

from __future__ import annotations

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
    "TORCH_DECODE",
    "PagedDecodeKernel",
    "build_paged_decode",
    "select_decode_kernel",
]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17")
# Shared by every process of a user (tests, CI, workers): compiled once per machine kind.
DEFAULT_BUILD_ROOT = Path.home() / ".cache" / "baton" / "torch_extensions"
TORCH_DECODE = "torch"  # the name of the fallback in logs and stats


@dataclass(frozen=True, slots=True)
class PagedDecodeKernel:
    """``torch.ops.baton.paged_decode``: decode attention over the paged pool."""

    name: str = "paged_decode_cpp"

    def __call__(
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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_dir(root: Path) -> Path:
    key = "\n".join(
        (_SOURCE.read_text(), " ".join(_CFLAGS), torch.__version__, _cpu_flags())
    ).encode()
    return root / f"paged_decode_{hashlib.sha256(key).hexdigest()[:16]}"


@functools.cache
def build_paged_decode(build_root: Path = DEFAULT_BUILD_ROOT) -> PagedDecodeKernel:
    """Compile (first time on this machine) and load the kernel; raise if it cannot be built.

    Cached per process: the library registers ``torch.ops.baton`` once."""
    from torch.utils import cpp_extension

    build_dir = _build_dir(build_root)
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        log.warning(
            "building the CPU paged decode-attention kernel into %s (once, ~10 s)", build_dir
        )
    started = time.perf_counter()
    cpp_extension.load(
        name="baton_paged_decode",
        sources=[str(_SOURCE)],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        log.warning(
            "built the paged decode-attention kernel in %.1f s", time.perf_counter() - started
        )
    return PagedDecodeKernel()


def select_decode_kernel(
    device: torch.device, *, enabled: bool = True, build_root: Path = DEFAULT_BUILD_ROOT
) -> PagedDecodeKernel | None:
    """The kernel for a model on ``device``, or None for the torch path (logged either way)."""
    if not enabled or device.type != "cpu":
        why = "turned off" if not enabled else f"the model is on {device.type}"
        log.info("decode attention: %s path (%s)", TORCH_DECODE, why)
        return None
    try:
        kernel = build_paged_decode(build_root)
    except Exception as e:  # no compiler, a failed build or load: the torch path still works
        log.warning("decode attention: %s path (the C++ kernel did not build: %s)", TORCH_DECODE, e)
        return None
    log.info("decode attention: %s", kernel.name)
    return kernel


def main() -> None:
    """``python -m services.engine.paged_decode``: build the kernel now (``make test`` does)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    build_paged_decode()
    print(
        f"paged decode-attention kernel ready in {_build_dir(DEFAULT_BUILD_ROOT)} "
        f"({time.perf_counter() - started:.1f} s)",
        flush=True,
    )


if __name__ == "__main__":
    main()
