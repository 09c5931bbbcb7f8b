"""A prefill engine in its own OS process that lends its KV blocks over a connector.

Driven over a pipe by ``test_kv_engine_e2e``: ``("prefill", request_id, prompt,
max_tokens)`` runs a prefill-only request, holds its blocks under a lease whose
release calls ``engine.release_held``, and answers with the handle and the first
token. Between commands it keeps calling ``conn.progress()`` so pulls complete.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from kvtransfer import KVConnector, make_connector
from services.backends import make_engine
from services.backends.protocol import Engine
from services.config import EngineConfig, ModelConfig
from services.engine.messages import EngineRequest, SamplingParams

BLOCK_SIZE = 4


def build_engine() -> Engine:
    cfg = EngineConfig(device="cpu", block_size=BLOCK_SIZE, kv_cache_bytes=2**20, max_model_len=64)
    return make_engine("embedded", ModelConfig(name="tiny", seed=0), cfg)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class PrefillWorker:
    """An engine plus a connector: the holder side of a disaggregated request."""

    def __init__(self, backend: str) -> None:
        self.engine = build_engine()
        self.conn: KVConnector = make_connector(backend, transfer_timeout_s=5.0)
        self.conn.register("kv", self.engine.kv_storage, self.engine.kv_layout)
        self.released: list[str] = []

    def prefill(self, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> Any:
        self.engine.add_request(EngineRequest(request_id, prompt, greedy(max_tokens), True))
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    first = out
        assert first.held_kv is not None, "prefill-only request did not hold its KV"

        def on_release(_ids: Any) -> None:
            self.engine.release_held(request_id)
            self.released.append(request_id)

        handle = self.conn.hold("kv", first.held_kv.block_ids, on_release=on_release)
        return handle, first.new_token_ids

    def num_held_blocks(self) -> int:
        return self.engine.stats().num_held_blocks


def _serve(backend: str, pipe: Any) -> None:
    torch.set_num_threads(1)
    worker = PrefillWorker(backend)
    pipe.send(("ready",))
    while True:
        if pipe.poll(0.001):
            match pipe.recv():
                case ("prefill", str(rid), tuple(prompt), int(max_tokens)):
                    pipe.send(("prefilled", *worker.prefill(rid, prompt, max_tokens)))
                case ("status",):
                    pipe.send(("status", list(worker.released), worker.num_held_blocks()))
                case ("stop",):
                    worker.conn.close()
                    return
        worker.conn.progress()


class PrefillProcess:
    def __init__(self, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(backend, child), daemon=True)
        self.process.start()
        self._call(None, timeout_s=120.0)

    def prefill(self, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> Any:
        _, handle, first = self._call(("prefill", request_id, prompt, max_tokens))
        return handle, first

    def status(self) -> tuple[list[str], int]:
        _, released, num_held = self._call(("status",))
        return released, num_held

    def stop(self) -> None:
        if self.process.is_alive():
            self._pipe.send(("stop",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()

    def _call(self, msg: tuple[Any, ...] | None, timeout_s: float = 60.0) -> tuple[Any, ...]:
        if msg is not None:
            self._pipe.send(msg)
        if not self._pipe.poll(timeout_s):
            raise TimeoutError(f"prefill process did not answer {msg!r}")
        reply: tuple[Any, ...] = self._pipe.recv()
        return reply
