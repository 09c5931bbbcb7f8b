"""Oracle: prompt logprobs (``SamplingParams.prompt_logprobs``) equal the log-softmax of
Hugging Face's logits at the position before each prompt token, whether the prompts
run in one step or in chunks among others, through a prefix already cached, or after
a preemption; they go out once, with the request's first output."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.messages import (
    EngineRequest,
    InvalidRequestError,
    RequestOutput,
    TokenLogprob,
)
from services.engine.prompt_logprobs import PromptSpan, prompt_spans
from services.engine.request import Request
from services.engine.scheduler import ScheduledRequest
from tests.unit.engine.engine_helpers import greedy, make_engine, run_all

PROMPT_LENS = (1, 3, 17, 40)
NUM_TOP = 3
BLOCK_SIZE = 4


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_prompt_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """[P - 1, vocab]: row ``p`` scores prompt token ``p + 1``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def first_outputs(outputs: dict[str, list[RequestOutput]]) -> dict[str, RequestOutput]:
    for outs in outputs.values():  # sent once: with the first output, never after
        assert all(o.prompt_logprobs is None for o in outs[1:])
    return {rid: outs[0] for rid, outs in outputs.items()}


def assert_equal_hf(model: Any, prompt: list[int], out: RequestOutput) -> None:
    expected = hf_prompt_logprobs(model, prompt)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) - 1
    for p, lp in enumerate(got):
        assert lp.token_id == prompt[p + 1]
        assert lp.logprob == pytest.approx(float(expected[p, prompt[p + 1]]), abs=1e-4)
        top_values, top_ids = expected[p].topk(NUM_TOP)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_hf(hf_checkpoint: Any, chunk: int | None) -> None:
    ckpt = hf_checkpoint("llama")
    prompts = make_prompts(ckpt.model.config.vocab_size)
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = make_engine(ckpt.folder, block_size=BLOCK_SIZE, **kw)
    for i, p in enumerate(prompts):
        sampling = greedy(4, prompt_logprobs=NUM_TOP)
        engine.add_request(EngineRequest(f"r{i}", tuple(p), sampling))
    engine.add_request(EngineRequest("plain", tuple(prompts[2]), greedy(4)))
    first = first_outputs(run_all(engine))
    for i, p in enumerate(prompts):
        assert_equal_hf(ckpt.model, p, first[f"r{i}"])
    assert first["plain"].prompt_logprobs is None
    if chunk is not None:  # the 40-token prompt really ran in several steps
        assert max(s.num_prefill_tokens for s in engine.stats().recent_steps) <= chunk


def test_a_cached_prefix_is_computed_again(hf_checkpoint: Any) -> None:
    """A cached position has no logits: a request asking for prompt logprobs reads
    nothing from the prefix cache, and all its positions are scored."""
    ckpt = hf_checkpoint("llama")
    prompt = make_prompts(ckpt.model.config.vocab_size)[3]
    engine = make_engine(ckpt.folder, block_size=BLOCK_SIZE)
    engine.add_request(EngineRequest("warm", tuple(prompt), greedy(2)))
    assert first_outputs(run_all(engine))["warm"].num_cached_tokens == 0
    engine.add_request(EngineRequest("again", tuple(prompt), greedy(2)))
    assert first_outputs(run_all(engine))["again"].num_cached_tokens == 36  # cached
    engine.add_request(EngineRequest("scored", tuple(prompt), greedy(2, prompt_logprobs=NUM_TOP)))
    out = first_outputs(run_all(engine))["scored"]
    assert out.num_cached_tokens == 0
    assert_equal_hf(ckpt.model, prompt, out)


def test_preempted_prompts_send_theirs_once(hf_checkpoint: Any) -> None:
    ckpt = hf_checkpoint("llama")
    cfg = ckpt.model.config
    block_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * BLOCK_SIZE * 16 * 4
    # 24 blocks = 96 tokens: each request fits alone (40 + 40 at most), not all at once.
    engine = make_engine(
        ckpt.folder,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=24 * block_bytes,
        admission="blocks",
        max_num_batched_tokens=8,
    )
    prompts = make_prompts(cfg.vocab_size)
    for i, p in enumerate(prompts * 2):
        engine.add_request(EngineRequest(f"r{i}", tuple(p), greedy(40, prompt_logprobs=NUM_TOP)))
    first = first_outputs(run_all(engine))
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(prompts * 2):
        assert_equal_hf(ckpt.model, p, first[f"r{i}"])


def test_a_continuation_sends_none() -> None:
    """Tokens already generated elsewhere: the prompt's logprobs went out there."""
    engine = make_engine()
    sampling = greedy(3, prompt_logprobs=0)
    engine.add_request(EngineRequest("c", (5, 6, 7, 8), sampling, output_token_ids=(9,)))
    engine.add_request(EngineRequest("n", (5, 6, 7, 8), sampling))
    first = first_outputs(run_all(engine))
    assert first["c"].prompt_logprobs is None
    got = first["n"].prompt_logprobs
    assert got is not None and [lp.token_id for lp in got] == [6, 7, 8]
    assert all(lp.top == () for lp in got)  # 0: the prompt token alone


def test_out_of_range_is_refused_by_name() -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(EngineRequest("x", (5, 6), greedy(2, prompt_logprobs=21)))
    assert err.value.param == "prompt_logprobs"


def test_a_recomputed_prompt_scores_only_what_it_had_not() -> None:
    """A prompt preempted part-way runs again from position 0: its rows before the
    tokens already scored are skipped, and the step's rows are counted across requests."""
    other = Request("o", (1, 2, 3), greedy(2))
    r = Request("r", tuple(range(3, 13)), greedy(2, prompt_logprobs=0), prompt_logprobs=[])
    r.prompt_logprobs = [TokenLogprob(t, -1.0) for t in range(4, 9)]  # tokens 1..5 scored
    spans = prompt_spans([ScheduledRequest(other, 3), ScheduledRequest(r, 8)])
    # Positions 5, 6, 7 of its chunk 0..7 (rows 3 + 5 ...) score tokens 6, 7, 8.
    assert spans == [PromptSpan(r, 8, 6, 3)]
    r.prompt_logprobs += [TokenLogprob(t, -1.0) for t in range(9, 12)]  # tokens 1..8
    # The last chunk, positions 8 and 9: 8 scores token 9; 9, the last, scores no prompt
    # token (its logits give the first output).
    r.num_computed_tokens = 8
    assert prompt_spans([ScheduledRequest(r, 2)]) == [PromptSpan(r, 0, 9, 1)]
