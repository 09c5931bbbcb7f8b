"""Disaggregated serving across two OS processes equals colocated serving, per backend.

Process A (spawned; in-process for ``local``) prefills with the embedded ``tiny``
engine and lends the prompt's KV blocks; this process adopts the request,
pulls the blocks over the connector into the ids ``adopt`` returned, and
decodes. The tokens must equal serving the request in one engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtransfer import TransferState, available_backends, make_connector
from services.engine.messages import EngineRequest
from tests.integration.kv_prefill_worker import (
    PrefillProcess,
    PrefillWorker,
    build_engine,
    greedy,
)

BACKENDS = [pytest.param("local"), pytest.param("nixl"), pytest.param("torch")]
PROMPTS = ["The quick brown fox jumps", "Relay races hand over a baton between runners."]
MAX_TOKENS = 8


class InProcessPrefill:
    """``local`` peers share an address space, so process A is a second engine here."""

    def __init__(self, backend: str) -> None:
        self.worker = PrefillWorker(backend)

    def prefill(self, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> Any:
        return self.worker.prefill(request_id, prompt, max_tokens)

    def status(self) -> tuple[list[str], int]:
        self.worker.conn.progress()
        return list(self.worker.released), self.worker.num_held_blocks()

    def stop(self) -> None:
        self.worker.conn.close()


@pytest.fixture(scope="module", params=BACKENDS)
def prefill_side(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    backend: str = request.param
    if backend not in available_backends():
        pytest.skip(f"backend {backend} is not installed")
    side = InProcessPrefill(backend) if backend == "local" else PrefillProcess(backend)
    yield backend, side
    side.stop()


def colocated_tokens(prompt: tuple[int, ...]) -> list[int]:
    engine = build_engine()
    engine.add_request(EngineRequest("c", prompt, greedy(MAX_TOKENS)))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("text", PROMPTS)
def test_pulled_kv_decodes_like_colocated(prefill_side: tuple[str, Any], text: str) -> None:
    backend, side = prefill_side
    decode = build_engine()
    conn = make_connector(backend, transfer_timeout_s=5.0)
    conn.register("kv", decode.kv_storage, decode.kv_layout)
    try:
        prompt = tuple(decode.encode(text))
        rid = f"r-{abs(hash(text)) % 10_000}"
        handle, first = side.prefill(rid, prompt, MAX_TOKENS)
        block_ids = decode.adopt(
            EngineRequest(rid, prompt, greedy(MAX_TOKENS), output_token_ids=tuple(first))
        )
        tid = conn.pull(handle, "kv", block_ids)
        deadline = time.monotonic() + 10.0
        while not (state := conn.poll(tid)).is_final and time.monotonic() < deadline:
            side.status() if backend == "local" else None
        assert state is TransferState.DONE
        decode.start_adopted(rid)
        rest: list[int] = []
        while decode.has_unfinished():
            for o in decode.step():
                rest.extend(o.new_token_ids)
        assert [*first, *rest] == colocated_tokens(prompt)
        # the prefill side heard of the completion and gave its blocks back
        deadline = time.monotonic() + 5.0
        while (status := side.status())[0].count(rid) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        released, num_held = status
        assert released.count(rid) == 1 and num_held == 0
    finally:
        conn.close()
