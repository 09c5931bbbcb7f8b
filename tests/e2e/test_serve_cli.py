"""``baton serve`` as a user runs it: a subprocess, a port, curl-like requests, SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from tests.unit.engine.conftest import build_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _baton_serve(args: list[str], env: dict[str, str], ready_s: float) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", *args, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "server not ready in time"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        yield base
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
        assert f"http://127.0.0.1:{port}/v1" in output  # it said where it listens
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def test_make_serve_config_answers_a_chat_completion() -> None:
    """What ``make serve`` runs, on a fresh Ray: ready, answers, stops cleanly on SIGTERM."""
    args = ["--config", "deploy/configs/local.yaml"]
    with _baton_serve(args, _env(), ready_s=90) as base:
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["message"]["role"] == "assistant"


def test_model_folder_greedy_equals_transformers(ray_cluster: str, tmp_path: Path) -> None:
    checkpoint = build_checkpoint("qwen2", tmp_path / "qwen2-tiny", seed=3)
    prompts = ["hello world the cat", "the cat sat on the mat", "a"]
    expected = []
    tok = checkpoint.model  # noqa: F841 - the model is the oracle below
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(checkpoint.folder))
    for prompt in prompts:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = checkpoint.model.generate(
                ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        expected.append(hf_tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    args = [
        "--model",
        str(checkpoint.folder),
        "--served-model-name",
        "qwen2-tiny",
        "--dtype",
        "float32",
        "--kv-backend",
        "nixl",
        "--policy",
        "round_robin",
        "--worker-cpus",
        "0",
    ]
    with _baton_serve(args, _env(RAY_ADDRESS=ray_cluster), ready_s=120) as base:
        for prompt, text in zip(prompts, expected, strict=True):
            r = httpx.post(
                f"{base}/v1/completions",
                json={
                    "model": "qwen2-tiny",
                    "prompt": prompt,
                    "max_tokens": 10,
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
