"""Oracle: greedy generations equal Hugging Face ``generate`` token for token.

Eight prompts of different lengths run together in one continuous batch, once with
a prefill chunk smaller than the longest prompt and once with a KV pool too small
for all of them at once (so requests are preempted and recomputed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from services.engine.messages import EngineRequest
from tests.unit.engine.engine_helpers import greedy, make_engine, serve

NUM_NEW = 64
PROMPT_LENS = (3, 7, 12, 17, 24, 31, 40, 50)
BLOCK_SIZE = 4


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    # No EOS: generation runs exactly NUM_NEW tokens, as ignore_eos does in our engine.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="module")
def oracle(hf_checkpoint: Callable[[str], Any]) -> Callable[[str], tuple[Any, list[list[int]]]]:
    cache: dict[str, tuple[Any, list[list[int]]]] = {}

    def get(kind: str) -> tuple[Any, list[list[int]]]:
        if kind not in cache:
            ckpt = hf_checkpoint(kind)
            prompts = make_prompts(ckpt.model.config.vocab_size)
            cache[kind] = (ckpt, [hf_greedy(ckpt.model, p) for p in prompts])
        return cache[kind]

    return get


def requests(prompts: list[list[int]]) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", tuple(p), greedy(NUM_NEW)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill_in_one_batch_equals_hf(kind: str, oracle: Any) -> None:
    ckpt, expected = oracle(kind)
    prompts = make_prompts(ckpt.model.config.vocab_size)
    engine = make_engine(ckpt.folder, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    got = serve(engine, requests(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    # The batch really was continuous and chunked: one step mixed decodes and a prefill chunk.
    steps = engine.stats().recent_steps
    assert max(s.num_prefill_tokens for s in steps) <= 16
    assert engine.stats().num_preemptions == 0


def test_long_prompts_prefilled_in_threshold_chunks_equal_hf(oracle: Any) -> None:
    ckpt, expected = oracle("llama")
    prompts = make_prompts(ckpt.model.config.vocab_size)
    engine = make_engine(ckpt.folder, block_size=BLOCK_SIZE, long_prefill_token_threshold=8)
    for r in requests(prompts):
        engine.add_request(r)
    got: dict[str, list[int]] = {}
    prefilled = []  # prompt tokens of each step
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        prefilled.append(engine.stats().recent_steps[-1].num_prefill_tokens)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    # All eight prompts went side by side in chunks of at most 8 tokens (one step of all
    # 184 without the threshold): 3 + 7 + 6x8 first, then what was left of each, 8 at most.
    left, chunks = list(PROMPT_LENS), []
    while any(left):
        chunks.append(sum(min(8, n) for n in left))
        left = [max(0, n - 8) for n in left]
    assert prefilled[: len(chunks)] == chunks
    assert not any(prefilled[len(chunks) :])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_preemption_under_a_small_pool_equals_hf(kind: str, oracle: Any) -> None:
    ckpt, expected = oracle(kind)
    cfg = ckpt.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * BLOCK_SIZE * head_dim * 4
    # 48 blocks = 192 tokens: the longest request (114) fits, all eight (700) do not.
    engine = make_engine(
        ckpt.folder, block_size=BLOCK_SIZE, kv_cache_bytes=48 * block_bytes, admission="blocks"
    )
    assert engine.stats().num_total_blocks == 48
    got = serve(engine, requests(make_prompts(cfg.vocab_size)))
    assert [got[f"r{i}"] for i in range(len(PROMPT_LENS))] == expected
    assert engine.stats().num_preemptions > 0


def test_repetition_penalty_equals_hf(hf_checkpoint: Callable[[str], Any]) -> None:
    """vLLM's repetition_penalty is transformers' (a seen token's logit divided by it,
    multiplied where negative; the prompt's tokens seen too): greedy generations with it
    equal ``generate(repetition_penalty=...)``, in one chunked batch."""
    ckpt = hf_checkpoint("llama")
    model = ckpt.model
    model.generation_config.eos_token_id = None
    prompts = make_prompts(model.config.vocab_size)[:4]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=1.8,
                pad_token_id=0,
            )
        expected.append([int(t) for t in out[0, len(p) :]])
    engine = make_engine(ckpt.folder, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    got = serve(
        engine,
        [
            EngineRequest(f"r{i}", tuple(p), greedy(24, repetition_penalty=1.8))
            for i, p in enumerate(prompts)
        ],
    )
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    plain = serve(make_engine(ckpt.folder, block_size=BLOCK_SIZE), requests(prompts))
    assert [plain[f"r{i}"][:24] for i in range(len(prompts))] != expected  # it bites
