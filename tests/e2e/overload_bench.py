"""``benchmarks/overload.py`` as a module, for the live tests that run its server,
workload and SLO (the benchmarks folder is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from loadgen.server_proc import ROOT


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overload_bench", ROOT / "benchmarks/overload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
