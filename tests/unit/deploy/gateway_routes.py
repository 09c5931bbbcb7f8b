"""The gateway's HTTP routes, the one place the deploy tests learn them from.

When ``services/gateway/app.py`` exists, the routes are read from the FastAPI app (its
module-level ``app`` or a no-argument ``create_app()``), or failing that from the route
decorators in its source. Until then they are the constant below, which mirrors what the
gateway serves (issue 7): keep it in step with the gateway, and drop it once the app is in.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

__all__ = ["GATEWAY_ROUTES", "gateway_routes"]

GATEWAY_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
    }
)

_REPO = Path(__file__).resolve().parents[3]
_APP_FILE = _REPO / "services" / "gateway" / "app.py"
_DECORATOR_METHODS = {"get", "post", "put", "delete", "patch", "head"}


def _routes_from_app() -> frozenset[tuple[str, str]] | None:
    module = importlib.import_module("services.gateway.app")
    app = getattr(module, "app", None)
    factory = getattr(module, "create_app", None)
    if app is None and callable(factory):
        try:
            app = factory()
        except TypeError:  # the factory needs arguments: fall back to the source
            return None
    if app is None:
        return None
    routes: set[tuple[str, str]] = set()
    for route in getattr(app, "routes", []):
        for method in getattr(route, "methods", None) or {"GET"}:
            routes.add((method, route.path))
    return frozenset(routes)


def _routes_from_source(folder: Path) -> frozenset[tuple[str, str]]:
    """Paths named by ``@x.get("/p")``-style decorators and ``add_api_route("/p", ...)``."""
    routes: set[tuple[str, str]] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            first = node.args[0] if node.args else None
            if not (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.startswith("/")  # not dict.get("key") and the like
            ):
                continue
            if name in _DECORATOR_METHODS:
                routes.add((name.upper(), first.value))
            elif name in ("add_api_route", "add_route", "route"):
                routes.add(("GET", first.value))
    return frozenset(routes)


def gateway_routes() -> frozenset[tuple[str, str]]:
    """(method, path) of every route the gateway serves."""
    if not _APP_FILE.exists():
        return GATEWAY_ROUTES
    routes = _routes_from_app() or _routes_from_source(_APP_FILE.parent)
    if not routes:
        raise AssertionError(f"{_APP_FILE} exists but no routes could be read from it")
    return routes
