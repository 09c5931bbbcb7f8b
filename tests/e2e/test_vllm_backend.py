"""Baton over vLLM (its CPU build), for real: colocated and 1P+1D over vLLM's NixlConnector,
driven through the official ``openai`` client, against vLLM's own ``LLM.generate``.

The text-equality cases run ``baton serve --backend vllm`` as a user does (a subprocess);
the telemetry, hang-up and kill cases use an in-process gateway over Ray actors, to reach
the workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from services.workers.messages import WorkerSnapshot
from tests.support.cluster import real_service, tiny_config, worker_snapshots
from tests.support.serve_cli import baton_serve, serve_env
from tests.support.server import ServedGateway
from tests.support.vllm import build_vllm_checkpoint, vllm_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.vllm]

LEASE_S = 2.0
# 16 prompts of token ids (the word tokenizer's ids 3..95), lengths 6..141, budgets 8..38.
PROMPTS = [[3 + (i * 7 + j * 13) % 93 for j in range(6 + (i * 37) % 136)] for i in range(16)]
MAX_TOKENS = [8 + (i * 11) % 31 for i in range(16)]


def _vllm_config(folder: Path, **overrides: object) -> object:
    return tiny_config(
        **{
            "model.name": str(folder),
            "model.served_model_name": "m",
            "model.dtype": "float32",
            "engine.backend": "vllm",
            "engine.vllm": {"enforce_eager": True},
            "engine.max_model_len": 512,
            "kvtransfer.lease_s": LEASE_S,
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_checkpoint(tmp_path_factory.mktemp("vllm-llama"))


def _vllm_generate(
    checkpoint: Path, prompts: list[list[int]], budgets: list[int], **sampling: float
) -> list[tuple[str, list[int]]]:
    """vLLM's own offline engine, greedy (in a process of its own)."""
    import ray

    @ray.remote(num_cpus=0, max_calls=1)
    def generate(
        folder: str, prompts: list[list[int]], budgets: list[int], sampling: dict[str, float]
    ) -> list[tuple[str, list[int]]]:
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=folder,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            max_model_len=512,
            kv_cache_memory_bytes=8 * 2**20,
        )
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **sampling)
            for n in budgets
        ]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]

    ref: list[tuple[str, list[int]]] = ray.get(
        generate.remote(str(checkpoint), prompts, budgets, sampling), timeout=300
    )
    return ref


@pytest.fixture(scope="module")
def reference(checkpoint: Path, ray_cluster: str) -> list[tuple[str, list[int]]]:
    """vLLM's own offline engine on the same prompts."""
    return _vllm_generate(checkpoint, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def expected(reference: list[tuple[str, list[int]]]) -> list[str]:
    return [text for text, _ in reference]


@pytest.fixture(scope="module")
def colocated(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``baton serve --backend vllm --mode colocated``: its base URL."""
    layout = ["--mode", "colocated", "--prefill", "1", "--decode", "0"]
    args = vllm_serve_args(checkpoint, tmp_path_factory.mktemp("colocated"), LEASE_S, *layout)
    with baton_serve(args, serve_env(), ready_s=240) as base:
        yield base


@pytest.fixture(scope="module")
def disaggregated(checkpoint: Path, ray_cluster: str) -> Iterator[ServedGateway]:
    config = _vllm_config(checkpoint, **{"workers.prefill": 1, "workers.decode": 1})
    with ServedGateway(real_service(config, ray=True, replace_dead=True)) as server:  # type: ignore[arg-type]
        yield server


async def _stream_all(base_url: str) -> list[str]:
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: list[int], max_tokens: int) -> str:
        stream = await client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    try:
        return await asyncio.gather(*(one(p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)))
    finally:
        await client.close()


def _wait_until_idle(server: ServedGateway, within_s: float) -> dict[str, WorkerSnapshot]:
    deadline = time.monotonic() + within_s
    while True:
        snaps = worker_snapshots(server)
        if all(s.num_held_blocks == 0 and s.num_used_blocks == 0 for s in snaps.values()):
            return snaps
        assert time.monotonic() < deadline, {
            w: (s.num_held_blocks, s.num_used_blocks) for w, s in snaps.items()
        }
        time.sleep(0.1)


def test_colocated_text_equals_vllm_generate(colocated: str, expected: list[str]) -> None:
    assert len(set(expected)) == len(expected)  # the prompts really give different texts
    assert asyncio.run(_stream_all(colocated)) == expected


def test_baton_serve_one_prefill_one_decode_equals_vllm_generate(
    checkpoint: Path, tmp_path: Path, expected: list[str]
) -> None:
    """``baton serve --backend vllm --prefill 1 --decode 1``: KV over vLLM's NixlConnector."""
    args = vllm_serve_args(checkpoint, tmp_path, LEASE_S, "--prefill", "1", "--decode", "1")
    with baton_serve(args, serve_env(), ready_s=240) as base:
        assert asyncio.run(_stream_all(base)) == expected
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    moved = [
        line for line in metrics.splitlines() if line.startswith("baton_kv_transfer_bytes_total")
    ]
    assert moved and float(moved[0].split()[-1]) > 0, moved


def test_prefill_decode_over_nixl_equals_vllm_generate(
    disaggregated: ServedGateway, expected: list[str]
) -> None:
    assert asyncio.run(_stream_all(disaggregated.base_url)) == expected
    # The decoder's telemetry shows a pulled request's tokens, its prompt's KV included
    # (what the router prices decode memory by). Asked while a long request decodes: a
    # poll racing the 16 short ones above saw none of them running once in a CI run.
    prompt = PROMPTS[3]  # 117 tokens
    assert len(prompt) > 100
    assert _held_on_decode_while_decoding(disaggregated, prompt) >= len(prompt)
    snaps = _wait_until_idle(disaggregated, LEASE_S + 3)
    assert snaps["prefill-0"].num_finished_requests >= 16
    assert snaps["decode-0"].num_finished_requests >= 16
    assert disaggregated.svc.metrics.transfer_bytes.labels("nixl")._value.get() > 0


def test_echo_with_logprobs_over_nixl_equals_transformers(
    disaggregated: ServedGateway, checkpoint: Path
) -> None:
    """A prompt scored through vLLM's prefill worker (``prompt_logprobs``), its first
    token's decode on the other worker: the echoed tokens' logprobs are transformers'
    log-softmax at the position before each."""
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[5][:24]
    client = OpenAI(base_url=disaggregated.base_url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="m", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected[:, 0].tolist(), abs=1e-3)
    assert all(v is not None for v in lp.token_logprobs[len(prompt) :])  # the outputs'


def _held_on_decode_while_decoding(server: ServedGateway, prompt: list[int]) -> int:
    """The most tokens decode-0's snapshots show held by a running request while
    ``prompt`` decodes 300 tokens there, asked after each of its deltas from decode-0
    until one shows the prompt's KV."""
    from services.engine.messages import SamplingParams

    sampling = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    client = server.svc.controller.client("decode-0")
    assert client is not None

    async def run() -> int:
        held = 0
        stream = server.svc.generate("held", tuple(prompt), sampling, time.monotonic())
        async with aclosing(stream):
            async for delta in stream:
                if delta.worker_id == "decode-0" and held < len(prompt):
                    snap = await client.snapshot()
                    held = max([held, *(r.num_tokens_held for r in snap.running)])
        return held

    held: int = server.call(run(), timeout_s=120)
    return held


def test_hang_up_after_the_first_token_frees_the_prefill_blocks_within_the_lease(
    disaggregated: ServedGateway,
) -> None:
    """The client leaves after the prefill's token, before any decoder pulls: the
    prefill worker holds the prompt's blocks, and vLLM's lease (kvtransfer.lease_s,
    handed to its NixlConnector as kv_lease_duration) frees them."""
    from services.engine.messages import SamplingParams

    sampling = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def hang_up() -> None:
        stream = disaggregated.svc.generate(
            "hang-up", tuple(PROMPTS[5]), sampling, time.monotonic()
        )
        async for _ in stream:
            break
        await stream.aclose()  # what a client disconnect does to the request's generator

    _wait_until_idle(disaggregated, LEASE_S + 3)
    disaggregated.call(hang_up())
    hung_up_s = time.monotonic()
    held = worker_snapshots(disaggregated)["prefill-0"].num_held_blocks
    assert held >= 1  # nobody pulled: the prompt's blocks wait for a decoder
    _wait_until_idle(disaggregated, LEASE_S + 3)
    assert time.monotonic() - hung_up_s >= LEASE_S - 0.5  # freed by the lease, not before


def test_prefill_worker_killed_after_the_first_token_still_gives_the_same_text(
    disaggregated: ServedGateway, reference: list[tuple[str, list[int]]]
) -> None:
    """Kill the prefill worker as its first token arrives, before the decoder pulls:
    the decoder's pull fails and it computes the prompt itself; one stream, same tokens."""
    import ray

    from services.engine.messages import SamplingParams

    index = 9
    sampling = SamplingParams(max_tokens=MAX_TOKENS[index], temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[int], set[str]]:
        tokens: list[int] = []
        workers: set[str] = set()
        prompt = tuple(PROMPTS[index])
        async for delta in disaggregated.svc.generate(
            "kill-prefill", prompt, sampling, time.monotonic()
        ):
            if not tokens:
                client = disaggregated.svc.controller.client(delta.worker_id)
                assert delta.worker_id.startswith("prefill") and client is not None
                ray.kill(client.actor, no_restart=True)  # type: ignore[attr-defined]
            tokens.extend(delta.token_ids)
            workers.add(delta.worker_id)
        return tokens, workers

    tokens, workers = disaggregated.call(run(), timeout_s=120)
    assert tokens == reference[index][1]
    assert any(w.startswith("decode") for w in workers)


def test_repetition_penalty_equals_vllm_generate(
    colocated: str, checkpoint: Path, expected: list[str]
) -> None:
    """vLLM's ``repetition_penalty`` reaches vLLM (it was ignored, with a warning)."""
    from openai import OpenAI

    client = OpenAI(base_url=colocated + "/v1", api_key="x", max_retries=0, timeout=60)
    got = [
        client.completions.create(
            model="m",
            prompt=PROMPTS[i],
            max_tokens=MAX_TOKENS[i],
            temperature=0.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 1.8},
        )
        .choices[0]
        .text
        for i in range(4)
    ]
    reference = _vllm_generate(checkpoint, PROMPTS[:4], MAX_TOKENS[:4], repetition_penalty=1.8)
    assert got == [text for text, _ in reference]
    assert got != expected[:4]  # it changed the text


def test_vllm_prefix_cache_hits_are_in_usage(colocated: str) -> None:
    """vLLM's prefix cache, as OpenAI's usage shows it: a prompt of 129 tokens sent
    twice has its first block (128 tokens) cached the second time."""
    from openai import OpenAI

    prompt = PROMPTS[7]
    assert len(prompt) == 129
    client = OpenAI(base_url=colocated + "/v1", api_key="x", max_retries=0, timeout=60)
    cached = []
    for _ in range(2):
        usage = client.completions.create(model="m", prompt=prompt, max_tokens=2).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached[1] == 128 and cached[0] in (0, 128)


def test_structured_outputs_and_logit_bias_reach_vllm(colocated: str) -> None:
    """The backend-neutral constraint and logit_bias are vLLM's own on this backend."""
    from openai import OpenAI

    client = OpenAI(base_url=colocated + "/v1", api_key="x", max_retries=0, timeout=60)
    choices = ["cat", "mat", "hello"]
    for i in range(4):
        r = client.completions.create(
            model="m",
            prompt=PROMPTS[i],
            max_tokens=8,
            temperature=0.0,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].text.strip() in choices, r.choices[0].text
    forced = client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=4, temperature=0.0, logit_bias={"40": 100}
    )
    assert forced.choices[0].text.split() == ["w27"] * 4  # id 40 is the word "w27"


def test_vllm_writes_compact_json_and_names_a_bad_constraint(
    tmp_path: Path, ray_cluster: str
) -> None:
    """A random model that may write free whitespace wanders into it (tabs and carriage
    returns until max_tokens, found by a QA pass): JSON from vLLM is compact, as from the
    embedded engine. A constraint vLLM cannot compile is refused naming its field."""
    from transformers import AutoTokenizer

    from services.config import EngineConfig, ModelConfig
    from services.engine.messages import (
        EngineRequest,
        InvalidRequestError,
        SamplingParams,
        StructuredOutput,
    )
    from tests.support.vllm import RemoteEngine

    folder = build_vllm_checkpoint(tmp_path / "bytes", byte_level=True)
    model = ModelConfig(name=str(folder), dtype="float32", seed=0)
    cfg = EngineConfig(
        device="cpu", kv_cache_bytes=4 * 2**20, max_model_len=256, vllm={"enforce_eager": True}
    )
    engine = RemoteEngine("vllm", model, cfg)
    try:
        json_object = StructuredOutput("json_object", param="response_format")
        for i in range(4):
            sampling = SamplingParams(max_tokens=40, temperature=0.0, structured=json_object)
            engine.add_request(EngineRequest(f"j{i}", tuple(range(40 + i, 60 + 3 * i)), sampling))
        outs: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
        texts = [AutoTokenizer.from_pretrained(str(folder)).decode(t) for t in outs.values()]
        assert len(texts) == 4 and all(t.startswith("{") for t in texts), texts
        # Raw tabs and line breaks are only ever whitespace between tokens in JSON.
        assert not any(c in t for t in texts for c in "\t\r\n"), texts

        bad = StructuredOutput("regex", "(unclosed", param="structured_outputs")
        sampling = SamplingParams(max_tokens=4, temperature=0.0, structured=bad)
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(EngineRequest("bad", (40, 41), sampling))
        assert err.value.param == "structured_outputs", err.value
    finally:
        engine.close()
