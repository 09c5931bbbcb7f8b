"""An in-process gateway over FakeEngine workers (no Ray): fast, for wire-format tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from services.backends.fake import FakeTokenizer
from services.cluster.controller import ControllerConfig
from services.cluster.factories import ConnectorFactory, FakeEngineFactory
from services.cluster.launchers import launch_in_process
from services.cluster.specs import worker_specs
from services.config import ClusterConfig
from services.gateway.app import create_app
from services.gateway.service import GatewayService, GatewaySettings

MODEL = "fake-model"


def fake_config(**overrides: Any) -> ClusterConfig:
    base = {
        "model.served_model_name": MODEL,
        "kvtransfer.backend": "local",
        "kvtransfer.lease_s": 2.0,
        "router.policy": "round_robin",
        "router.max_hold_s": 0.0,
        "workers.num_cpus": 0,
    }
    return ClusterConfig().with_overrides({**base, **overrides})


def fake_service(
    config: ClusterConfig,
    max_model_len: int = 512,
    engine_factory: Callable[[], Any] | None = None,
) -> GatewayService:
    specs = worker_specs(
        config,
        engine_factory or FakeEngineFactory(max_model_len=max_model_len),
        ConnectorFactory(config.kvtransfer),
    )
    settings = GatewaySettings(
        config.gateway, config.router, config.model, config.kvtransfer.backend
    )
    return GatewayService(
        settings,
        FakeTokenizer(),
        specs,
        launch_in_process,
        controller_config=ControllerConfig(replace_dead=False),
    )


GatewayFactory = Callable[..., Any]


@pytest.fixture
async def gateway() -> AsyncIterator[GatewayFactory]:
    """``await gateway(**overrides) -> (service, httpx client)``; everything stopped after."""
    started: list[tuple[GatewayService, httpx.AsyncClient]] = []

    async def make(
        max_model_len: int = 512, engine_factory: Callable[[], Any] | None = None, **overrides: Any
    ) -> tuple[GatewayService, httpx.AsyncClient]:
        svc = fake_service(fake_config(**overrides), max_model_len, engine_factory)
        await svc.start()
        app = create_app(svc, manage_lifecycle=False)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        started.append((svc, client))
        return svc, client

    yield make
    for svc, client in started:
        await client.aclose()
        await svc.stop()
