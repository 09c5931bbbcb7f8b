"""Picklable recipes a worker runs inside its own process to build its engine and connector."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.connector import KVConnector
from services.backends.protocol import Engine
from services.config import EngineConfig, KVTransferConfig, ModelConfig

__all__ = ["ConnectorFactory", "EngineFactory", "FakeEngineFactory"]


@dataclass(frozen=True, slots=True)
class EngineFactory:
    backend: str
    model: ModelConfig
    engine: EngineConfig

    def __call__(self) -> Engine:
        import torch

        from services.backends import make_engine  # type: ignore[attr-defined]

        if self.engine.num_threads is not None:
            torch.set_num_threads(self.engine.num_threads)
        engine: Engine = make_engine(self.backend, self.model, self.engine)
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
