"""Embedded engine throughput against Hugging Face ``generate`` on the same weights, same run.

For each model (the built-in ``tiny``; a ~100M-parameter Llama with random
weights saved by transformers into a temp folder) and batch size, B prompts of
equal length (so ``generate`` needs no padding) are served greedily:

* prefill tokens/s: prompt tokens / time until every request has its first token
  (ours: the first step; baseline: from calling ``generate`` to its first token);
* decode tokens/s: tokens after the first / the time from the first token to the last.

Both are read off one run per side: HF ``generate`` is timed by a stopping
criterion that stamps each new token. (Subtracting a ``max_new_tokens=1`` run
from a longer one would add that run's noise to HF's decode time only, and the
best-of-N below would then favour HF's luckiest difference.)

Both sides get the same weights, prompts, threads, greedy decoding and number
of new tokens, and a warm-up; HF runs with its defaults (SDPA attention,
``DynamicCache``). The best of ``--repeats`` alternated runs is kept. On CPU the
clock is the process's CPU time (``--clock wall`` for elapsed time): on a shared
machine other processes' time slices would otherwise land on whichever side ran then.

One JSON object per line: model, phase, batch, tokens_per_s, baseline_tokens_per_s, ratio.
Decode rows add ``matmul_floor_tokens_per_s``: the rate if a step did nothing but
the model's own ``F.linear`` calls at that batch (no attention, no Python), an
upper bound for any implementation on the same kernels, and ``gflop_per_s`` /
``baseline_gflop_per_s``: the linear-layer FLOPs each side achieves.
Usage: ``python benchmarks/engine.py [--device cuda] [--threads 2] [--models tiny,llama100m]
[--clock wall]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadgen.scripts import load_script
from services.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.loader import LoadedModel, load_model
from services.engine.messages import EngineRequest, SamplingParams
from services.engine.tiny import tiny_hf_config

# The random checkpoints it measures (which other benchmarks and tests build too).
_checkpoints = load_script(
    Path(__file__).resolve().with_name("checkpoints.py"), "bench_checkpoints"
)


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    num_new_tokens: int  # after the first


@dataclass(frozen=True)
class Phases:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


_CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter  # chosen once in main()


def now() -> float:
    return _clock()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- models ----------------------------------------------------------------------------


def hf_tiny(loaded: LoadedModel) -> Any:
    """A transformers Llama holding the built-in tiny model's weights."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_hf_config())
    state = {k: v for k, v in loaded.model.hf_state_dict().items() if not k.startswith("rotary")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [k for k in missing if "rotary" not in k] or unexpected:
        raise RuntimeError(f"tiny -> HF weight mismatch: {missing} {unexpected}")
    return model


# -- measurements ----------------------------------------------------------------------


def prompts_for(batch: int, w: Workload, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 8, (batch, w.prompt_len), generator=g).tolist()


def run_ours(loaded: LoadedModel, prompts: list[list[int]], w: Workload, device: str) -> Phases:
    batch = len(prompts)
    per_token = loaded.args.num_layers * 2 * loaded.args.num_kv_heads * loaded.args.head_dim * 4
    tokens = batch * (w.prompt_len + w.num_new_tokens + 1)
    cfg = EngineConfig(
        device="cuda" if device.startswith("cuda") else "cpu",
        block_size=16,
        kv_cache_bytes=max(2**20, 2 * tokens * per_token),
        max_num_seqs=batch,
        max_num_batched_tokens=batch * w.prompt_len,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(loaded, cfg)
    sampling = SamplingParams(max_tokens=1 + w.num_new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", tuple(p), sampling))
    sync(device)
    t0 = now()
    first = engine.step()
    sync(device)
    t1 = now()
    assert len(first) == batch, "every prompt should prefill in one step"
    while engine.has_unfinished():
        engine.step()
    sync(device)
    t2 = now()
    return Phases(batch * w.prompt_len / (t1 - t0), batch * w.num_new_tokens / (t2 - t1))


def run_hf(model: Any, prompts: list[list[int]], w: Workload, device: str) -> Phases:
    """One ``generate`` call, timed like ours: a stopping criterion stamps every new token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TokenClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps_s: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> Any:
            sync(device)
            self.stamps_s.append(now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor(prompts, device=device)
    model.generation_config.eos_token_id = None
    clock = TokenClock()
    sync(device)
    t0 = now()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=1 + w.num_new_tokens,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    first_s, last_s = clock.stamps_s[0], clock.stamps_s[-1]
    assert len(clock.stamps_s) == 1 + w.num_new_tokens, "one stamp per new token"
    batch = len(prompts)
    return Phases(
        batch * w.prompt_len / (first_s - t0), batch * w.num_new_tokens / (last_s - first_s)
    )


def linear_flops_per_token(loaded: LoadedModel) -> int:
    """Multiply-adds x 2 of every linear layer (the LM head included) for one token."""
    return sum(2 * m.weight.numel() for m in loaded.model.modules() if isinstance(m, nn.Linear))


def matmul_floor_tokens_per_s(loaded: LoadedModel, batch: int, device: str, repeats: int) -> float:
    """Decode tokens/s of a step made of the model's linear layers only, at ``batch`` rows."""
    weights = [m.weight for m in loaded.model.modules() if isinstance(m, nn.Linear)]
    inputs = [torch.randn(batch, w.shape[1], device=device, dtype=w.dtype) for w in weights]

    def step() -> None:
        for x, w in zip(inputs, weights):
            F.linear(x, w)

    step()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = now()
        for _ in range(8):
            step()
        sync(device)
        times.append((now() - t0) / 8)
    return batch / min(times)


def best(runs: list[Phases]) -> Phases:
    return Phases(
        max(r.prefill_tokens_per_s for r in runs), max(r.decode_tokens_per_s for r in runs)
    )


def bench_model(
    name: str,
    loaded: LoadedModel,
    hf_model: Any,
    w: Workload,
    batches: list[int],
    device: str,
    repeats: int,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    hf_model = hf_model.to(device).float().eval()
    vocab = loaded.args.vocab_size
    warm = prompts_for(2, Workload(8, 2), vocab, seed=99)
    run_ours(loaded, warm, Workload(8, 2), device)
    run_hf(hf_model, warm, Workload(8, 2), device)
    for batch in batches:
        prompts = prompts_for(batch, w, vocab, seed=batch)
        # Alternate the two and keep each one's best: on a shared machine the noise is one-sided.
        runs = [(run_ours(loaded, prompts, w, device), run_hf(hf_model, prompts, w, device))]
        runs += [
            (run_ours(loaded, prompts, w, device), run_hf(hf_model, prompts, w, device))
            for _ in range(repeats - 1)
        ]
        ours = best([o for o, _ in runs])
        base = best([b for _, b in runs])
        common = {
            "prompt_len": w.prompt_len,
            "num_new_tokens": w.num_new_tokens,
            "device": device,
            "clock": "wall" if _clock is time.perf_counter else "cpu",
        }
        prefill = row(name, "prefill", batch, ours.prefill_tokens_per_s, base.prefill_tokens_per_s)
        emit(prefill | common)
        gflop_per_token = linear_flops_per_token(loaded) / 1e9
        decode = row(name, "decode", batch, ours.decode_tokens_per_s, base.decode_tokens_per_s)
        floor = matmul_floor_tokens_per_s(loaded, batch, device, repeats)
        emit(
            decode
            | {
                "matmul_floor_tokens_per_s": round(floor, 1),
                "gflop_per_s": round(ours.decode_tokens_per_s * gflop_per_token, 2),
                "baseline_gflop_per_s": round(base.decode_tokens_per_s * gflop_per_token, 2),
            }
            | common
        )


def row(model: str, phase: str, batch: int, mine: float, theirs: float) -> dict[str, Any]:
    return {
        "model": model,
        "phase": phase,
        "batch": batch,
        "tokens_per_s": round(mine, 1),
        "baseline_tokens_per_s": round(theirs, 1),
        "ratio": round(mine / theirs, 3),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (more than free cores thrash)"
    )
    ap.add_argument("--models", default="tiny,llama100m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each; the best is kept")
    ap.add_argument(
        "--clock",
        choices=sorted(_CLOCKS),
        help="cpu: this process's CPU seconds, which time slices lost to other processes on a "
        "shared machine do not inflate (default on CPU); wall: elapsed time (default on CUDA)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global _clock
    clock = args.clock or ("wall" if args.device.startswith("cuda") else "cpu")
    _clock = _CLOCKS[clock]
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    on_gpu = args.device.startswith("cuda")

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    for name in args.models.split(","):
        match name:
            case "tiny":
                loaded = load_model("tiny", dtype="float32", device=args.device)
                w = Workload(prompt_len=128, num_new_tokens=64)
                bench_model(
                    name, loaded, hf_tiny(loaded), w, batches, args.device, args.repeats, emit
                )
            case "llama100m":
                with tempfile.TemporaryDirectory() as tmp:
                    hf_model = _checkpoints.save_llama_100m(Path(tmp))
                    loaded = load_model(tmp, dtype="float32", device=args.device)
                    w = Workload(
                        prompt_len=256 if on_gpu else 32, num_new_tokens=64 if on_gpu else 16
                    )
                    bench_model(name, loaded, hf_model, w, batches, args.device, args.repeats, emit)
            case _:
                raise SystemExit(f"unknown model {name!r}; known: tiny, llama100m")


if __name__ == "__main__":
    main()
