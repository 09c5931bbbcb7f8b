"""``baton serve`` as a user runs it: a subprocess, a port, curl-like requests, SIGTERM."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.serve_cli import baton_serve, serve_env
from tests.unit.engine.conftest import build_checkpoint

pytestmark = pytest.mark.slow


def test_make_serve_config_answers_a_chat_completion() -> None:
    """What ``make serve`` runs, on a fresh Ray: ready, answers, stops cleanly on SIGTERM.
    With a key (from the environment): no process shows it in its arguments."""
    args = ["--config", "deploy/configs/local.yaml"]
    key = "sk-never-in-argv-" + os.urandom(6).hex()
    with baton_serve(args, serve_env(BATON_API_KEY=key), ready_s=90) as base:
        cmdlines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if _readable(p)]
        assert any(b"services.cli" in c and b"serve" in c for c in cmdlines)
        assert not any(key.encode() in c for c in cmdlines)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).status_code == 401
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["message"]["role"] == "assistant"


def test_a_fan_out_of_64_sequences_fits_one_idle_colocated_worker_under_the_defaults() -> None:
    """4 prompts x n=16 on one colocated tiny worker, slo_goodput with TTFT 2 s / TPOT
    200 ms (the defaults): a 429 while the router priced every colocated step as
    carrying a full 2047-token prefill chunk (0.227 s) where the chunk was 3 tokens."""
    args = ["--model", "tiny", "--mode", "colocated", "--prefill", "1", "--decode", "0"]
    args += ["--worker-cpus", "0", "--log-level", "warning"]
    with baton_serve(args, serve_env(), ready_s=180) as base:
        fan_out = {"model": "tiny", "prompt": ["hi there"] * 4, "n": 16, "max_tokens": 8}
        r = httpx.post(f"{base}/v1/completions", json=fan_out, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 64


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return False
    return True


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
    with baton_serve(args, serve_env(RAY_ADDRESS=ray_cluster), ready_s=120) as base:
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
