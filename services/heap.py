"""Keeping the cyclic garbage collector's full passes off the serving path.

A process that has imported torch and transformers holds millions of objects made once,
at start; every full (generation 2) collection walks all of them. Measured live, 2
prefill + 2 decode at 48 req/s: full collections of 357 ms in the gateway and 270 ms in
the load client, pauses in which no stream moves and refusals wait (the slowest 429s,
300-540 ms, while the router decided each in under 4 ms). ``freeze_startup_heap``, once
start-up is over (in ``baton serve``/``baton gateway``, ``baton bench`` and
``benchmarks/overload.py``; never inside a library call, whose caller's heap it is),
moves what exists into the collector's permanent generation (``gc.freeze``): reference
counting still frees those objects, and a full collection walks only what serving has
made since.

The cyclic collector's young passes still run while serving, a few milliseconds each on
a busy 2-core host; in a load client they land inside the latencies it times.
``collector_paused`` keeps the collector off for one timed run (as ``timeit`` does) and
collects once it ends: ``loadgen.overload`` times its runs without the client's own
pauses.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused", "freeze_startup_heap"]


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block; afterwards the collector is as it was, and
    what the block left for it is collected at once (outside anything timed)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()
