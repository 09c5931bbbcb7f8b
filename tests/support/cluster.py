"""Building gateway services for tests: Ray or in-process workers, real or fake engines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.cluster.controller import ControllerConfig
from services.cluster.factories import factories_for
from services.cluster.launchers import RayLauncher, launch_in_process
from services.cluster.specs import worker_specs
from services.config import ClusterConfig
from services.engine.loader import load_tokenizer
from services.gateway.service import GatewayService, GatewaySettings


def tiny_config(**overrides: Any) -> ClusterConfig:
    base = {
        "model.name": "tiny",
        "engine.device": "cpu",
        "engine.num_threads": 1,
        "engine.kv_cache_bytes": 8 * 2**20,
        "kvtransfer.lease_s": 2.0,
        "kvtransfer.transfer_timeout_s": 5.0,
        "router.policy": "round_robin",
        "router.max_hold_s": 0.0,
        "workers.num_cpus": 0,
    }
    return ClusterConfig().with_overrides({**base, **overrides})


def real_service(
    config: ClusterConfig,
    *,
    ray: bool,
    replace_dead: bool = False,
    wrap_engine: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None,
) -> GatewayService:
    """``wrap_engine``: a test's fault injector around the real engine factory."""
    engine_factory, connector_factory = factories_for(config)
    if wrap_engine is not None:
        engine_factory = wrap_engine(engine_factory)
    specs = worker_specs(config, engine_factory, connector_factory)
    settings = GatewaySettings(
        config.gateway, config.router, config.model, config.kvtransfer.backend
    )
    launcher = RayLauncher(num_cpus=config.workers.num_cpus, num_gpus=0) if ray else None
    return GatewayService(
        settings,
        load_tokenizer(config.model.name),
        specs,
        launcher or launch_in_process,
        controller_config=ControllerConfig(replace_dead=replace_dead),
    )


def worker_snapshots(server: Any) -> dict[str, Any]:
    """A fresh snapshot of every worker of a served gateway (tests.support.server)."""

    async def fresh() -> dict[str, Any]:
        out = {}
        for worker_id in server.svc.controller.workers():
            client = server.svc.controller.client(worker_id)
            assert client is not None
            out[worker_id] = await client.snapshot()
        return out

    result: dict[str, Any] = server.call(fresh())
    return result
