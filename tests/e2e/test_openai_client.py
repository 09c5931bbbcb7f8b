"""The official ``openai`` client against a real uvicorn server on a socket.

Workers run the real tiny engine in-process (disaggregated, ``local`` connector);
the Ray path is covered in tests/integration and by the ``baton serve`` tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai import OpenAI

from router.policy import register_policy
from router.types import ClusterView, Reject, RequestProfile
from tests.support.cluster import real_service, tiny_config
from tests.support.server import ServedGateway

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about relay races."}]


@register_policy("e2e_always_reject")
@dataclass
class _AlwaysReject:
    name: str = "e2e_always_reject"

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Reject:
        return Reject("cluster full", retry_after_s=1.0)


@pytest.fixture(scope="module")
def server() -> Iterator[ServedGateway]:
    config = tiny_config(**{"kvtransfer.backend": "local", "gateway.max_body_bytes": 64 * 1024})
    with ServedGateway(real_service(config, ray=False)) as s:
        yield s


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServedGateway]:
    config = tiny_config(
        **{
            "workers.mode": "colocated",
            "gateway.api_key": "sekret",
            "router.policy": "e2e_always_reject",
        }
    )
    with ServedGateway(real_service(config, ray=False)) as s:
        yield s


@pytest.fixture
def client(server: ServedGateway) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0)


def test_models_list_and_retrieve(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/not-served")  # a slash in a name is one name
    assert missing.value.code == "model_not_found" and "org/not-served" in missing.value.message


def test_chat_stream_equals_non_stream_with_usage(client: OpenAI, server: ServedGateway) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed is not None and whole.usage is not None
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    expected_prompt = len(
        server.svc.tokenizer.encode(
            server.svc.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False
        )
    )
    assert whole.usage.prompt_tokens == expected_prompt
    assert whole.usage.completion_tokens <= 16
    # The same prompt again, on the one prefill worker: its full blocks came from its
    # prefix cache (the last token is always computed), and usage says so.
    block = tiny_config().engine.block_size
    assert streamed.prompt_tokens_details is not None and whole.usage.prompt_tokens_details
    cached = streamed.prompt_tokens_details.cached_tokens
    assert cached == (expected_prompt - 1) // block * block > 0
    assert whole.usage.prompt_tokens_details.cached_tokens <= cached
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counted = [line for line in metrics.splitlines() if line.startswith("baton_prompt_cached")]
    assert counted and float(counted[0].split()[-1]) >= cached, counted


def test_completions_stream_and_not(client: OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="relay", max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt="relay", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in (
        "stop",
        "length",
    )


def test_echo_with_logprobs_scores_the_prompt(client: OpenAI) -> None:
    """``echo`` with ``logprobs`` (how evaluation harnesses score a text): the prompt's
    tokens come first, the first with null logprobs, the others with the values the
    engine computes for them, through a prefill worker and a decode worker; streamed,
    the same tokens and values."""
    from services.backends.embedded import make_embedded_engine
    from services.engine.messages import EngineRequest, SamplingParams

    kwargs = dict(model=MODEL, prompt="the relay race", max_tokens=4, temperature=0, echo=True)
    whole = client.completions.create(**kwargs, logprobs=2)  # type: ignore[call-overload]
    choice = whole.choices[0]
    lp = choice.logprobs
    num_prompt = whole.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 4 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # Two alternatives each, keyed by text (byte tokens that show alike share a key).
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value <= 0 and 1 <= len(top) <= 2 and top.get(token, value) == value

    config = tiny_config()
    engine = make_embedded_engine(config.model, config.engine)
    prompt = tuple(engine.encode("the relay race"))
    assert len(prompt) == num_prompt
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    engine.add_request(EngineRequest("direct", prompt, sampling))
    (out,) = engine.step()
    assert out.prompt_logprobs is not None
    expected = [x.logprob for x in out.prompt_logprobs]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-5)

    chunks = list(client.completions.create(**kwargs, logprobs=2, stream=True))  # type: ignore[call-overload]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert chunks[0].choices[0].text == "the relay race"  # the echo, with its logprobs

    alone = client.completions.create(**{**kwargs, "max_tokens": 0}, logprobs=2)  # type: ignore[call-overload]
    assert alone.choices[0].text == "the relay race" and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:num_prompt]


def test_n_and_seeds(client: OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt="baton", max_tokens=12, temperature=1.0, seed=seed, n=2
        )
        assert [c.index for c in out.choices] == [0, 1]
        return [c.text for c in out.choices]

    first = sample(7)
    assert sample(7) == first  # seeded sampling is reproducible
    assert sample(8) != first
    assert first[0] != first[1]  # the n choices draw differently


def test_stop_strings(client: OpenAI) -> None:
    # The tiny byte model's text is arbitrary: stop on a piece of its own greedy output.
    full = (
        client.completions.create(
            model=MODEL,
            prompt="stop here",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, full
    stop = full[clean[0] : clean[0] + 2]
    cut = client.completions.create(
        model=MODEL, prompt="stop here", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_error_classes(client: OpenAI, server: ServedGateway, guarded: ServedGateway) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)  # type: ignore[arg-type]
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)  # type: ignore[arg-type]
    wrong_key = OpenAI(base_url=f"{guarded.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    right_key = OpenAI(base_url=f"{guarded.base_url}/v1", api_key="sekret", max_retries=0)
    with pytest.raises(openai.RateLimitError) as limited:
        right_key.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert limited.value.response.headers["retry-after"] == "1"
    big = {"model": MODEL, "prompt": "x" * (128 * 1024)}
    r = httpx.post(f"{server.base_url}/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "PayloadTooLargeError"


def test_health_and_metrics(server: ServedGateway) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "baton_time_to_first_token_seconds",
        "baton_inter_token_latency_seconds",
        'baton_request_stage_seconds_count{stage="transfer"}',
        'baton_kv_transfer_bytes_total{backend="local"}',
    ):
        assert name in metrics


def test_non_streaming_client_that_gives_up_aborts_its_request(server: ServedGateway) -> None:
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1800, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)

    async def busy_workers() -> dict[str, int]:
        out = {}
        for worker_id in server.svc.controller.workers():
            client = server.svc.controller.client(worker_id)
            assert client is not None
            s = await client.snapshot()
            out[worker_id] = len(s.running) + s.num_held_blocks
        return out

    deadline = time.monotonic() + 3.0
    while any(server.call(busy_workers()).values()):
        assert time.monotonic() < deadline, server.call(busy_workers())
        time.sleep(0.05)
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'baton_requests_total{model="tiny",outcome="aborted"} 1.0' in text
