"""A benchmark script as a module: ``benchmarks/`` is a folder of scripts, not a
package, and some share builders (``benchmarks/engine.py``'s random Llamas) or a
server, workload and SLO (``benchmarks/overload.py``'s, with the live tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path, name: str) -> ModuleType:
    """Import the file at ``path`` as the module ``name`` (registered in
    ``sys.modules``: its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
