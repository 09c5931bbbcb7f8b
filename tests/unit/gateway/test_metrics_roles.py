"""``/metrics`` labels follow a worker's role: after a flip the old role's series go."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import generate_latest

from router.types import Role
from services.backends.fake import FakeTokenizer
from services.config import ClusterConfig
from services.gateway.service import GatewayService, GatewaySettings
from tests.unit.gateway.test_executor import snapshot


def test_a_flipped_worker_is_exported_under_its_new_role_only() -> None:
    served = ClusterConfig()
    settings = GatewaySettings(served.gateway, served.router, served.model, "local")
    svc = GatewayService(settings, FakeTokenizer(), [], None)  # type: ignore[arg-type]
    before = snapshot("w0", Role.DECODE)
    svc._on_snapshot(before)
    svc._on_snapshot(replace(before, role=Role.PREFILL, seq=2))
    text = generate_latest(svc.metrics.registry).decode()
    lines = [line for line in text.splitlines() if 'worker="w0"' in line and "role=" in line]
    assert lines and all('role="prefill"' in line for line in lines), lines
    assert 'baton_workers{role="decode",state="alive"} 0.0' in text
