"""Picklable recipes a worker runs inside its own process to build its engine and connector."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtransfer.connector import KVConnector
from services.backends.protocol import Engine
from services.config import ClusterConfig, EngineConfig, KVTransferConfig, ModelConfig

__all__ = [
    "ConnectorFactory",
    "EngineFactory",
    "FakeEngineFactory",
    "encode_engine_factory",
    "factories_for",
]


@dataclass(frozen=True, slots=True)
class EngineFactory:
    backend: str
    model: ModelConfig
    engine: EngineConfig
    # For backends that move their own KV (vLLM): the lease on held prefill blocks;
    # None when the worker never exchanges KV (colocated).
    kv_lease_s: float | None = None

    def __call__(self) -> Engine:
        import torch

        from services.backends import make_engine  # type: ignore[attr-defined]

        if self.engine.num_threads is not None:
            torch.set_num_threads(self.engine.num_threads)
        engine: Engine = make_engine(
            self.backend, self.model, self.engine, kv_lease_s=self.kv_lease_s
        )
        return engine


@dataclass(frozen=True, slots=True)
class FakeEngineFactory:
    """Builds a FakeEngine: for tests and gateway benchmarks that leave the model out."""

    num_blocks: int = 256
    block_size: int = 16
    max_model_len: int = 512

    def __call__(self) -> Engine:
        from services.backends.fake import FakeEngine

        return FakeEngine(
            num_blocks=self.num_blocks, block_size=self.block_size, max_model_len=self.max_model_len
        )


@dataclass(frozen=True, slots=True)
class ConnectorFactory:
    config: KVTransferConfig

    def __call__(self, agent_name: str) -> KVConnector:
        from kvtransfer import make_connector  # type: ignore[attr-defined]

        connector: KVConnector = make_connector(
            self.config.backend,
            agent_name=agent_name,
            lease_s=self.config.lease_s,
            transfer_timeout_s=self.config.transfer_timeout_s,
        )
        return connector


def factories_for(config: ClusterConfig) -> tuple[EngineFactory, ConnectorFactory | None]:
    """The engine and KV-connector recipes for ``config``'s workers.

    A backend that moves its own KV (vLLM) gets a kvtransfer connector only to pull
    encode workers' image embeddings (region ``mm``), when the config has encode
    workers; in disaggregated mode its engine is told the lease on held prefill blocks.
    Its encode workers run Baton's own engine (``encode_engine_factory``).
    """
    from services.backends import MOVES_OWN_KV  # type: ignore[attr-defined]

    engine = config.engine
    if engine.backend in MOVES_OWN_KV:
        disaggregated = config.workers.mode == "disaggregated"
        lease_s = config.kvtransfer.lease_s if disaggregated else None
        pulls_images = disaggregated and config.workers.encode > 0
        connector = ConnectorFactory(config.kvtransfer) if pulls_images else None
        return EngineFactory(engine.backend, config.model, engine, kv_lease_s=lease_s), connector
    return EngineFactory(engine.backend, config.model, engine), ConnectorFactory(config.kvtransfer)


def encode_engine_factory(factory: Callable[[], Engine]) -> Callable[[], Engine]:
    """What an encode worker runs beside text workers built by ``factory``: the same,
    except for a backend that moves its own KV (vLLM), which has no step that only
    encodes: there Baton's own engine loads the same checkpoint and its vision tower
    encodes (the text workers take the embeddings as precomputed image embeddings)."""
    from services.backends import MOVES_OWN_KV  # type: ignore[attr-defined]

    if isinstance(factory, EngineFactory) and factory.backend in MOVES_OWN_KV:
        return EngineFactory("embedded", factory.model, factory.engine)
    return factory
