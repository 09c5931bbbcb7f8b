"""From a ClusterConfig to the list of workers to launch."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtransfer.connector import KVConnector
from router.types import Role
from services.backends.protocol import Engine
from services.cluster.factories import encode_engine_factory
from services.cluster.resources import gpus_per_worker
from services.config import ClusterConfig
from services.workers.worker import WorkerSpec

__all__ = ["worker_specs"]

log = logging.getLogger(__name__)


def worker_specs(
    config: ClusterConfig,
    engine_factory: Callable[[], Engine],
    connector_factory: Callable[[str], KVConnector] | None,
    *,
    cluster_has_gpus: bool = False,
) -> list[WorkerSpec]:
    """One spec per worker; in colocated mode every worker is ``mixed`` and has no connector.

    Each spec carries the GPUs its actor asks for (``resources.gpus_per_worker``)."""
    w = config.workers
    if w.mode == "colocated":
        if w.encode:
            log.warning(
                "workers.encode=%d ignored: encode workers hand embeddings over a KV "
                "connector, which colocated mode has not (the workers encode their own images)",
                w.encode,
            )
        roles = [(Role.MIXED, w.prefill + w.decode + w.mixed)]
        connector_factory = None
    else:
        num_encode = w.encode
        if num_encode and connector_factory is None:
            # No kvtransfer connector to hand embeddings over: the prefilling workers
            # encode their own images (README, "Images").
            log.warning(
                "workers.encode=%d ignored: this backend encodes on its prefill workers", num_encode
            )
            num_encode = 0
        roles = [
            (Role.ENCODE, num_encode),
            (Role.PREFILL, w.prefill),
            (Role.DECODE, w.decode),
            (Role.MIXED, w.mixed),
        ]
    encoder = encode_engine_factory(engine_factory)
    return [
        WorkerSpec(
            worker_id=f"{role.value}-{i}",
            role=role,
            engine_factory=encoder if role is Role.ENCODE else engine_factory,
            connector_factory=connector_factory,
            # An encoder on another engine than the text workers' can serve no text role.
            fixed_role=role is Role.ENCODE and encoder is not engine_factory,
            nice=w.nice,
            prefill_nice=w.prefill_nice,
            telemetry_interval_s=w.telemetry_interval_s,
            max_num_seqs=config.engine.max_num_seqs,
            num_gpus=gpus_per_worker(config, role, cluster_has_gpus=cluster_has_gpus),
        )
        for role, count in roles
        for i in range(count)
    ]
