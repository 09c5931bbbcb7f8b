"""CUDA: the same parity checks in half precision (skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.engine.loader import load_model
from services.engine.messages import SamplingParams
from services.engine.sampler import Sampler
from tests.unit.engine.conftest import HFCheckpoint
from tests.unit.engine.test_model_parity import PagedRunner, _tokens

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_cuda_half_precision_matches_hf(
    hf_checkpoint: Callable[[str], HFCheckpoint], kind: str, dtype: str
) -> None:
    """Two sequences through chunked prefill, a mixed step and batched decode steps.

    The exact answer is transformers in float32 on the CPU. Half precision rounds, so
    the logits may be off by 5% of their largest value, and argmax must agree wherever
    the exact logits' top two are further apart than twice the largest error seen.
    """
    ckpt = hf_checkpoint(kind)
    loaded = load_model(str(ckpt.folder), dtype=dtype, device="cuda")
    assert loaded.model.lm_head.weight.device.type == "cuda"
    runner = PagedRunner(loaded.model)
    runner.kv = runner.kv.to("cuda")
    a, b = _tokens(20, seed=7), _tokens(14, seed=8)
    steps = [
        [("a", a[:12]), ("b", b[:9])],  # prefill, both
        [("a", a[12:17]), ("b", b[9:10])],  # a chunk beside a decode
        *([("a", [a[17 + j]]), ("b", [b[10 + j]])] for j in range(3)),  # decode, batched
    ]
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for step in steps:
        for (seq, _), logits in zip(step, runner.step(step), strict=True):
            got[seq].append(logits.float().cpu())
    for seq, prompt in (("a", a), ("b", b[:13])):  # b's 14th token is never fed
        ours = torch.cat(got[seq])
        ref = ckpt.logits(prompt)  # float32 on the CPU: the exact answer
        our_err = (ours - ref).abs().max().item()
        assert our_err < 0.05 * ref.abs().max().item(), (seq, our_err)
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * our_err
        assert decisive.float().mean() >= 0.25, "too few positions to compare argmax"
        assert torch.equal(ours.argmax(-1)[decisive], ref.argmax(-1)[decisive])


def test_cuda_sampler_seeded_matches_cpu() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    outputs: list[list[int]] = [[1, 2], [], [3], [4, 5, 6]]
    none = [torch.empty(0, dtype=torch.int64)] * 4
    cpu = Sampler().sample(logits, params, outputs, (2,), torch.Generator(), none)
    gpu = Sampler().sample(
        logits.cuda(), params, outputs, (2,), torch.Generator(device="cuda"), none
    )
    assert gpu.token_ids == cpu.token_ids
