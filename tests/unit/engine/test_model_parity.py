"""Our CausalLM over the paged cache must reproduce Hugging Face's logits (float32, 1e-4)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from services.engine.batch import ForwardBatch
from services.engine.cpu_kernels import build_cpu_kernels
from services.engine.loader import LoadedModel, load_model
from services.engine.model import CausalLM
from services.engine.rope import apply_rotary
from tests.unit.engine.conftest import HFCheckpoint

KINDS = ["llama", "llama_sharded", "llama3_rope", "mistral", "qwen2", "qwen3"]
TOL = 1e-4


class PagedRunner:
    """A minimal test-side scheduler: gives each sequence scattered blocks and runs steps."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4) -> None:
        a = model.args
        self.model = model
        self.block_size = block_size
        dtype = model.model.embed_tokens.weight.dtype
        self.kv = torch.zeros(
            num_blocks, a.num_layers, 2, a.num_kv_heads, block_size, a.head_dim, dtype=dtype
        )
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)  # block tables are not contiguous ranges
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, work: Sequence[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run new tokens for several sequences at once; return each one's [q, vocab] logits."""
        ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
        for seq, new in work:
            assert new, "a scheduled sequence runs at least one token"
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            for pos in range(start, start + len(new)):
                if pos // self.block_size >= len(table):
                    table.append(self.free.pop())
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
                positions.append(pos)
            ids.extend(new)
            self.lens[seq] = start + len(new)
            query_lens.append(len(new))
            context_lens.append(self.lens[seq])
            tables.append(list(table))
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
        )
        logits = self.model.compute_logits(self.model(batch, self.kv))
        return list(torch.split(logits, query_lens))


def _tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    return [random.Random(seed * 1000 + i).randrange(3, vocab) for i in range(n)]


@pytest.fixture(params=[(k, ops) for k in KINDS for ops in ("torch", "cpp")], ids=str)
def pair(
    request: pytest.FixtureRequest, hf_checkpoint: Callable[[str], HFCheckpoint]
) -> tuple[HFCheckpoint, LoadedModel]:
    kind, ops = request.param
    ckpt = hf_checkpoint(kind)
    loaded = load_model(str(ckpt.folder))
    if ops == "cpp":  # the C++ kernels of cpu_kernels.py, as the engine picks them on a CPU
        loaded.model.cpu_kernels = build_cpu_kernels()
    return ckpt, loaded


def test_full_prompt_in_one_forward(pair: tuple[HFCheckpoint, LoadedModel]) -> None:
    ckpt, loaded = pair
    prompt = _tokens(13, seed=1)
    (ours,) = PagedRunner(loaded.model).step([("a", prompt)])
    torch.testing.assert_close(ours, ckpt.logits(prompt), atol=TOL, rtol=0)


def test_prompt_in_two_chunks_reuses_the_cache(pair: tuple[HFCheckpoint, LoadedModel]) -> None:
    ckpt, loaded = pair
    prompt = _tokens(14, seed=2)
    runner = PagedRunner(loaded.model)
    (first,) = runner.step([("a", prompt[:6])])
    (second,) = runner.step([("a", prompt[6:])])
    torch.testing.assert_close(torch.cat([first, second]), ckpt.logits(prompt), atol=TOL, rtol=0)


def test_mixed_batch_of_chunks_and_decodes(pair: tuple[HFCheckpoint, LoadedModel]) -> None:
    ckpt, loaded = pair
    seqs = {
        "a": _tokens(11, seed=3),
        "b": _tokens(5, seed=4),
        "c": _tokens(18, seed=5),
        "d": _tokens(6, seed=6),
        "e": _tokens(9, seed=7),
    }
    # Each step: (seq, how many of its next tokens). Prefill chunks of various lengths run
    # beside decodes (1 token), and sequences join and leave the batch.
    schedule = [
        [("a", 8), ("b", 2)],
        [("a", 1), ("b", 3), ("c", 6)],
        [("a", 1), ("b", 0), ("c", 7)],
        [("a", 1), ("c", 1), ("d", 6)],  # a fresh prompt beside decodes
        [("c", 1), ("d", 0), ("e", 4)],
        [("e", 5), ("c", 1)],
        [("c", 1), ("c2", 0)],
        [("c", 1)],
    ]
    runner = PagedRunner(loaded.model)
    done = dict.fromkeys(seqs, 0)
    got: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in schedule:
        work = [(s, seqs[s][done[s] : done[s] + n]) for s, n in step if n > 0 and s in seqs]
        for (s, new), logits in zip(work, runner.step(work)):
            done[s] += len(new)
            got[s].append(logits)
    for s, toks in seqs.items():
        assert done[s] == len(toks)
        torch.testing.assert_close(torch.cat(got[s]), ckpt.logits(toks), atol=TOL, rtol=0)


def test_parity_check_detects_a_wrong_model(hf_checkpoint: Callable[[str], HFCheckpoint]) -> None:
    """The tolerance is meaningful: a slightly wrong RoPE base is far outside it."""
    ckpt = hf_checkpoint("llama")
    loaded = load_model(str(ckpt.folder))
    wrong = CausalLM(dataclasses.replace(loaded.args, rope_theta=20000.0))
    wrong.load_state_dict(loaded.model.state_dict())
    prompt = _tokens(13, seed=1)
    (ours,) = PagedRunner(wrong).step([("a", prompt)])
    assert (ours - ckpt.logits(prompt)).abs().max() > 100 * TOL


def test_bfloat16_is_close_to_float32(hf_checkpoint: Callable[[str], HFCheckpoint]) -> None:
    ckpt = hf_checkpoint("qwen3")
    loaded = load_model(str(ckpt.folder), dtype="bfloat16")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = _tokens(9, seed=6)
    (ours,) = PagedRunner(loaded.model).step([("a", prompt)])
    ref = ckpt.logits(prompt)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
    assert torch.equal(ours.argmax(-1)[:3], ref.argmax(-1)[:3])


def test_kv_lands_in_the_contract_layout() -> None:
    """K/V of token p go to kv[block, layer, 0 or 1, head, offset]: what KV transfer ships."""
    loaded = load_model("tiny")
    model, a = loaded.model, loaded.args
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    ids = loaded.tokenizer.encode("paged!")
    runner.step([("a", ids)])
    layer0 = model.model.layers[0]
    with torch.no_grad():
        h = layer0.input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
        qkv = layer0.self_attn.qkv_proj(h)
    q_dim, kv_dim = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    k = qkv[:, q_dim : q_dim + kv_dim].view(len(ids), a.num_kv_heads, a.head_dim)
    v = qkv[:, q_dim + kv_dim :].view(len(ids), a.num_kv_heads, a.head_dim)
    cos, sin = model.rotary.cos_sin(torch.arange(len(ids)), len(ids), torch.float32)
    k = apply_rotary(k, cos, sin)
    written = torch.zeros(runner.kv.shape[0], runner.block_size, dtype=torch.bool)
    for pos in range(len(ids)):
        block, offset = runner.tables["a"][pos // 4], pos % 4
        written[block, offset] = True
        torch.testing.assert_close(runner.kv[block, 0, 0, :, offset], k[pos])
        torch.testing.assert_close(runner.kv[block, 0, 1, :, offset], v[pos])
        assert runner.kv[block, 1, :, :, offset].abs().sum() > 0  # layer 1 written too
    untouched = runner.kv.permute(0, 4, 1, 2, 3, 5)[~written]
    assert untouched.abs().sum() == 0
