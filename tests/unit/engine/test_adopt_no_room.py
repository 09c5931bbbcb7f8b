"""A decode worker without room to adopt says so as a capacity error (the gateway places the
request elsewhere), never as a bad request (a 400 in the middle of a started stream)."""

from __future__ import annotations

import pytest

from services.backends import make_engine
from services.config import EngineConfig, ModelConfig
from services.engine.messages import (
    EngineRequest,
    InvalidRequestError,
    NoRoomError,
    SamplingParams,
)


@pytest.mark.parametrize("backend", ["fake"])  # embedded: tests/unit/engine/test_engine.py
def test_adopt_without_room_is_a_capacity_error(backend: str) -> None:
    probe = make_engine(backend, ModelConfig(name="tiny"), EngineConfig(device="cpu"))
    block_bytes = probe.kv_layout.block_bytes
    cfg = EngineConfig(device="cpu", block_size=4, kv_cache_bytes=8 * block_bytes // 4 * 4)
    engine = make_engine(backend, ModelConfig(name="tiny"), cfg)
    total = engine.stats().num_total_blocks
    prompt = tuple(range(5, 5 + 4 * (total + 2)))  # more blocks than the pool has
    request = EngineRequest("x", prompt[:200], SamplingParams(max_tokens=4), output_token_ids=(7,))
    with pytest.raises(NoRoomError) as info:
        engine.adopt(request)
    assert not isinstance(info.value, InvalidRequestError)
    assert engine.stats().num_free_blocks == total  # nothing was taken
