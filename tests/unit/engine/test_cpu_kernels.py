"""The C++ kernels (cpu_kernels.py) equal the torch ops they replace.

Decode and prefill attention: both paths run ``paged_attention`` on the same pool and batch; only
``cpu_kernels`` differs. Block tables are drawn from a shuffled pool (never contiguous
ranges), lengths are ragged and cross block edges, and heads are grouped (GQA) or not.
RMSNorm and rotary + KV write are compared with ``rms_norm`` and ``apply_rotary`` +
``write_kv`` on the same inputs.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from services.engine.attention import paged_attention, write_kv
from services.engine.attention_metadata import AttentionMetadata, PoolView
from services.engine.batch import ForwardBatch
from services.engine.cpu_kernels import CpuKernels, build_cpu_kernels
from services.engine.messages import EngineRequest
from services.engine.model import rms_norm
from services.engine.rope import RotaryEmbedding, apply_rotary
from tests.unit.engine.engine_helpers import greedy, make_engine, run_all, tokens_of


@pytest.fixture(scope="module")
def kernel() -> CpuKernels:
    return build_cpu_kernels()


def _batch(
    query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int, seed: int
) -> ForwardBatch:
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    positions, slots = [], []
    for q_len, n, table in zip(query_lens, context_lens, tables):
        for pos in range(n - q_len, n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=tables,
    )


def _attend(
    batch: ForwardBatch,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    window: int | None,
    kernel: CpuKernels | None,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    layers, layer = 3, 1
    kv = torch.randn(num_blocks, layers, 2, kv_heads, block_size, head_dim, generator=g)
    kv = kv.to(dtype)
    num_tokens = batch.num_tokens
    q = torch.randn(num_tokens, heads + kv_heads, head_dim, generator=g).to(dtype)[:, :heads]
    k_new = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    v_new = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    pool = PoolView.of(kv)
    meta = AttentionMetadata.build(
        batch,
        pool=pool,
        num_queries_per_kv=heads // kv_heads,
        sliding_window=window,
        device=torch.device("cpu"),
        dtype=dtype,
        cpu_kernels=kernel,
    )
    write_kv(pool, layer, meta, k_new, v_new)
    return paged_attention(q, k_new, v_new, pool, layer, meta, head_dim**-0.5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 6), (12, 4)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_equals_the_torch_path_at_decode(
    kernel: CpuKernels, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    context_lens = [1, 2, block_size, block_size + 1, 37, 5, 3 * block_size - 1, 70]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 9
    batch = _batch([1] * len(context_lens), context_lens, block_size, num_blocks, seed=head_dim)
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    kw |= dict(num_blocks=num_blocks, dtype=torch.float32, window=None)
    ours = _attend(batch, kernel=kernel, **kw)  # type: ignore[arg-type]
    torch_path = _attend(batch, kernel=None, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, torch_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 16])
def test_kernel_equals_the_torch_path_beside_chunks_and_with_a_window(
    kernel: CpuKernels, window: int | None
) -> None:
    # Decodes between prefill chunks: the kernel's output lands at its tokens' rows.
    query_lens, context_lens = [1, 5, 1, 1, 9, 1], [20, 12, 3, 41, 9, 17]
    block_size, num_blocks = 4, 64
    batch = _batch(query_lens, context_lens, block_size, num_blocks, seed=3)
    kw = dict(heads=8, kv_heads=2, head_dim=64, block_size=block_size, num_blocks=num_blocks)
    kw |= dict(dtype=torch.float32, window=window)
    ours = _attend(batch, kernel=kernel, **kw)  # type: ignore[arg-type]
    torch_path = _attend(batch, kernel=None, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, torch_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 6), (12, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_prefill_kernel_equals_the_torch_path_for_whole_prompts(
    kernel: CpuKernels, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    # Ragged prompts from one token to past a task's query rows (384 / group positions),
    # so a sequence spans several tasks and key tiles end mid-block.
    lens = [1, 2, 31, 33, 130, 7, 400]
    num_blocks = sum(-(-n // block_size) for n in lens) + 9
    batch = _batch(lens, lens, block_size, num_blocks, seed=head_dim + heads)
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    kw |= dict(num_blocks=num_blocks, dtype=torch.float32, window=None)
    ours = _attend(batch, kernel=kernel, **kw)  # type: ignore[arg-type]
    torch_path = _attend(batch, kernel=None, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, torch_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 5, 40, 200])
@pytest.mark.parametrize("head_dim", [48, 64])  # 48: no kernel for it, the torch path runs
def test_prefill_kernel_equals_the_torch_path_after_a_cached_prefix(
    kernel: CpuKernels, window: int | None, head_dim: int
) -> None:
    # Chunks whose first tokens sit deep in their context, beside decodes and a whole prompt.
    query_lens, context_lens = [130, 1, 64, 3, 300], [300, 90, 64, 250, 301]
    block_size, num_blocks = 16, 96
    batch = _batch(query_lens, context_lens, block_size, num_blocks, seed=5)
    kw = dict(heads=12, kv_heads=4, head_dim=head_dim, block_size=block_size)
    kw |= dict(num_blocks=num_blocks, dtype=torch.float32, window=window)
    ours = _attend(batch, kernel=kernel, **kw)  # type: ignore[arg-type]
    torch_path = _attend(batch, kernel=None, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, torch_path, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_in_bfloat16_is_close_to_the_float32_result(kernel: CpuKernels) -> None:
    lens = [5, 40, 129]
    batch = _batch(lens, lens, 16, 32, seed=2)
    kw = dict(heads=12, kv_heads=4, head_dim=64, block_size=16, num_blocks=32, window=None)
    ours = _attend(batch, kernel=kernel, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]
    exact = _attend(batch, kernel=None, dtype=torch.float32, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours.float(), exact, atol=2e-2, rtol=2e-2)


def test_prefill_kernel_refuses_rows_outside_the_step(kernel: CpuKernels) -> None:
    kv = torch.zeros(4, 1, 2, 1, 4, 16)
    q = torch.zeros(6, 2, 16)
    out = torch.empty(6, 32)
    lens = torch.tensor([5])
    with pytest.raises(RuntimeError, match="query rows out of range"):
        kernel.paged_prefill_(
            q, kv, 0, torch.tensor([[0, 1]]), torch.tensor([3]), lens, lens, 0.25, None, out
        )
    with pytest.raises(RuntimeError, match="block table is shorter"):
        kernel.paged_prefill_(
            q, kv, 0, torch.tensor([[0]]), torch.tensor([0]), lens, lens, 0.25, None, out
        )


def test_kernel_in_bfloat16_is_close_to_the_float32_result(kernel: CpuKernels) -> None:
    context_lens = [1, 9, 33, 64]
    batch = _batch([1] * 4, context_lens, 16, 32, seed=1)
    kw = dict(heads=12, kv_heads=4, head_dim=64, block_size=16, num_blocks=32, window=None)
    ours = _attend(batch, kernel=kernel, dtype=torch.bfloat16, **kw)  # type: ignore[arg-type]
    exact = _attend(batch, kernel=None, dtype=torch.float32, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(ours.float(), exact, atol=2e-2, rtol=2e-2)


def test_engine_reports_its_kernels_and_generates_the_same_tokens() -> None:
    with_kernel = make_engine("tiny")
    without = make_engine("tiny", cpu_kernels=False)
    assert with_kernel.stats().kernels == "cpp"
    assert without.stats().kernels == "torch"
    prompts = [[5, 9, 2, 7], list(range(3, 40)), [11] * 9]
    outs = []
    for engine in (with_kernel, without):
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", tuple(p), greedy(24)))
        outs.append({r: tokens_of(o) for r, o in run_all(engine).items()})
    assert outs[0] == outs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_equals_the_torch_ops(kernel: CpuKernels, dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 96, generator=g)).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ours = kernel.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(ours, rms_norm(x, weight, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rotary_write_equals_apply_rotary_and_write_kv(
    kernel: CpuKernels, dtype: torch.dtype, block_size: int
) -> None:
    heads, kv_heads, head_dim, layers, layer = 6, 2, 32, 3, 2
    query_lens, context_lens = [1, 7, 1, 70], [9, 7, 33, 90]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    batch = _batch(query_lens, context_lens, block_size, num_blocks, seed=block_size)
    args = SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None)
    cos, sin = RotaryEmbedding(args).cos_sin(  # type: ignore[arg-type]
        batch.positions, max(context_lens), dtype
    )
    g = torch.Generator().manual_seed(block_size)
    # q, k and v side by side as the fused qkv product gives them: strided rows.
    qkv = torch.randn(batch.num_tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]
    pools = [torch.zeros(num_blocks, layers, 2, kv_heads, block_size, head_dim, dtype=dtype)]
    pools.append(pools[0].clone())
    meta = AttentionMetadata.build(
        batch,
        pool=PoolView.of(pools[0]),
        num_queries_per_kv=heads // kv_heads,
        sliding_window=None,
        device=torch.device("cpu"),
        dtype=dtype,
    )
    expected = apply_rotary(qk, cos, sin)
    write_kv(PoolView.of(pools[0]), layer, meta, expected[:, heads:], v)
    kernel.rotary_write_(qk, v, cos, sin, pools[1], layer, meta.slots)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qk, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(pools[1], pools[0], atol=tol, rtol=tol)
    assert pools[1][:, layer].abs().sum() > 0 and pools[1][:, :layer].abs().sum() == 0


def test_torch_ops_are_chosen_where_the_kernels_cannot_build_or_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.engine import cpu_kernels

    def no_compiler(build_root: object = None) -> CpuKernels:
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(cpu_kernels, "build_cpu_kernels", no_compiler)
    assert cpu_kernels.select_cpu_kernels(torch.device("cpu")) is None
    assert cpu_kernels.select_cpu_kernels(torch.device("cuda")) is None
    assert cpu_kernels.select_cpu_kernels(torch.device("cpu"), enabled=False) is None
