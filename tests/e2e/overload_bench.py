"""``benchmarks/overload.py`` as a module, for the live tests that run its server,
workload and SLO (``test_phase_shift_live``)."""

from __future__ import annotations

from types import ModuleType

from loadgen.scripts import load_script
from loadgen.server_proc import ROOT


def load() -> ModuleType:
    return load_script(ROOT / "benchmarks/overload.py", "overload_bench")
