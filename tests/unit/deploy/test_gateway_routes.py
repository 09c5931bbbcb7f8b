"""The route discovery the probe test relies on reads real decorators, not lookalikes."""

from __future__ import annotations

from pathlib import Path

from tests.unit.deploy.gateway_routes import GATEWAY_ROUTES, _routes_from_source, gateway_routes


def test_routes_are_read_from_fastapi_decorators_only(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(
        "def create_app(svc):\n"
        "    app = FastAPI()\n"
        '    @app.get("/health", include_in_schema=False)\n'
        "    async def health(): ...\n"
        '    @app.post("/v1/completions")\n'
        "    async def completions(request):\n"
        '        return request.headers.get("authorization", "")\n'
        '    app.add_api_route("/metrics", metrics)\n'
        "    return app\n"
    )
    assert _routes_from_source(tmp_path) == {
        ("GET", "/health"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
    }


def test_the_routes_include_what_the_chart_probes_and_scrapes() -> None:
    routes = gateway_routes()
    assert {("GET", "/health"), ("GET", "/metrics")} <= routes
    assert routes >= GATEWAY_ROUTES  # the OpenAI routes too, once the real app is read
