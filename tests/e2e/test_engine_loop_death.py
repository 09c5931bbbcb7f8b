"""An engine loop that dies (a fault injected through the engine) is noticed within 5 s:
/ready shows its worker down meanwhile, the controller replaces it, and the requests it
was serving finish on live workers with the text an undisturbed run gives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

PROMPTS = [f"Baton pass {i}:" for i in range(8)]
MAX_TOKENS = 200


class LoopKilled(BaseException):
    """Not an Exception: the engine loop's per-step isolation does not catch it, so the
    loop's thread ends, as it would on a fault nothing can handle."""


class KillSwitch:
    """Armed by the test; the ``after_steps``-th engine step on a decode worker from then
    on kills its loop: counted in steps, not seconds, so the streams are mid-way however
    fast the machine decodes (armed 0.5 s after they started, they had all finished once
    in CI, and the fault never fired)."""

    def __init__(self, after_steps: int) -> None:
        self.armed = threading.Event()
        self.fired_s: float | None = None
        self._after_steps = after_steps
        self._num_steps = 0
        self._lock = threading.Lock()

    def maybe_fire(self) -> None:
        if not self.armed.is_set():
            return
        with self._lock:
            self._num_steps += 1
            if self.fired_s is not None or self._num_steps < self._after_steps:
                return
            self.fired_s = time.monotonic()
        raise LoopKilled("injected: the engine loop dies")


class FaultyEngine:
    """The real engine, whose step kills its loop once the switch is armed; a replacement
    takes a second to come up, as a real model's load does (tests only)."""

    def __init__(self, inner: Any, switch: KillSwitch, start_s: float) -> None:
        self._inner = inner
        self._switch = switch
        self._start_s = start_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def has_unfinished(self) -> bool:
        if self._start_s:  # the loop thread's first call: before its first snapshot
            time.sleep(self._start_s)
            self._start_s = 0.0
        return bool(self._inner.has_unfinished())

    def step(self) -> Any:
        if self._inner.has_unfinished() and self._decoding():
            self._switch.maybe_fire()
        return self._inner.step()

    def _decoding(self) -> bool:
        return bool(getattr(self, "is_decode", False))


def _faulty(switch: KillSwitch, decode_ids: list[int]) -> Callable[[Any], Callable[[], Any]]:
    def wrap(factory: Callable[[], Any]) -> Callable[[], Any]:
        def build() -> Any:
            # Workers are built in spec order: prefill-0, decode-0, decode-1, then successors.
            num_built = len(decode_ids)
            engine = FaultyEngine(factory(), switch, start_s=1.0 if num_built >= 3 else 0.0)
            engine.is_decode = num_built in (1, 2)
            decode_ids.append(0)
            return engine

        return build

    return wrap


def _stream_text(base_url: str, prompt: str) -> str:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
    return text


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_loop_is_replaced_and_its_requests_finish_unchanged() -> None:
    switch = KillSwitch(after_steps=20)  # of the 2 decode workers' ~2 x 200 steps
    built: list[int] = []
    config = tiny_config(
        **{"kvtransfer.backend": "local", "workers.prefill": 1, "workers.decode": 2}
    )
    svc = real_service(config, ray=False, replace_dead=True, wrap_engine=_faulty(switch, built))
    with ServedGateway(svc) as server:
        base = server.base_url
        with ThreadPoolExecutor(8) as pool:
            undisturbed = list(pool.map(lambda p: _stream_text(base, p), PROMPTS))
            switch.armed.set()
            futures = [pool.submit(_stream_text, base, p) for p in PROMPTS]
            down_seen_s = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                workers = httpx.get(f"{base}/ready", timeout=5).json()["workers"]
                if down_seen_s is None and any(w["state"] == "down" for w in workers):
                    down_seen_s = time.monotonic()
                if down_seen_s is not None and all(w["state"] == "ready" for w in workers):
                    break
                time.sleep(0.05)
            texts = [f.result(timeout=60) for f in futures]
        registry = server.svc.metrics.registry
        retried = registry.get_sample_value("baton_request_retries_total", {"reason": "internal"})
    assert switch.fired_s is not None, "the fault never fired"
    assert down_seen_s is not None, "/ready never showed the dead worker down"
    assert down_seen_s - switch.fired_s < 5.0
    assert any(w["worker_id"].endswith(".r1") and w["state"] == "ready" for w in workers)
    assert texts == undisturbed
    assert retried, "no request was re-placed: the dead worker served none"
