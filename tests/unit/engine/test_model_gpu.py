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
    ckpt = hf_checkpoint(kind)
    loaded = load_model(str(ckpt.folder), dtype=dtype, device="cuda")
    assert loaded.model.lm_head.weight.device.type == "cuda"
    runner = PagedRunner(loaded.model)
    runner.kv = runner.kv.to("cuda")
    prompt = _tokens(20, seed=7)
    (first,) = runner.step([("a", prompt[:12])])
    (second,) = runner.step([("a", prompt[12:])])
    ours = torch.cat([first, second]).cpu()
    ref = ckpt.logits(prompt)  # float32 on the CPU: the exact answer
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_cuda_sampler_seeded_matches_cpu() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    outputs: list[list[int]] = [[1, 2], [], [3], [4, 5, 6]]
    cpu = Sampler().sample(logits, params, outputs, (2,), torch.Generator())
    gpu = Sampler().sample(logits.cuda(), params, outputs, (2,), torch.Generator(device="cuda"))
    assert gpu.token_ids == cpu.token_ids
