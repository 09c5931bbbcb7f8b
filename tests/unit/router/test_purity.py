"""router/ stays pure: importable with Ray, torch and the HTTP stack unavailable, and it
never reads a clock or an unseeded random source."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import router

ROUTER_DIR = Path(router.__file__).parent
BLOCKED = ["ray", "torch", "fastapi", "httpx", "uvicorn", "starlette", "services", "kvtransfer"]


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages([str(ROUTER_DIR)], prefix="router.")]


def test_every_router_module_imports_with_heavy_dependencies_blocked() -> None:
    modules = _modules()
    assert {
        "router.front_door",
        "router.estimator",
        "router.cost_model",
        "router.policies.slo_goodput",
    } <= set(modules)
    code = "\n".join(
        [
            "import importlib, sys",
            f"for name in {BLOCKED!r}: sys.modules[name] = None",
            f"for name in {['router', *modules]!r}: importlib.import_module(name)",
            "from router import make_policy, available_policies",
            "for name in available_policies(): make_policy(name)",
            "from router import Router, RouterSettings",
            "for name in available_policies(): Router(RouterSettings(policy=name))",
            f"leaked = [m for m in {BLOCKED!r} if sys.modules.get(m) is not None]",
            "assert not leaked, leaked",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_no_clock_reads_or_unseeded_randomness() -> None:
    forbidden = re.compile(
        r"\bimport time\b|\bfrom time\b|\bdatetime\b|default_rng\(\)|\brandom\.(random|randint|choice)\("
        r"|np\.random\.(rand|random|randn|choice)\("
    )
    offenders = [
        f"{path.relative_to(ROUTER_DIR)}:{n}"
        for path in ROUTER_DIR.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert not offenders
