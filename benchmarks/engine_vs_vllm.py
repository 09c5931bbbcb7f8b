"""The embedded engine alone against vLLM's engine alone: same model, workload, thread, process.

    python benchmarks/engine_vs_vllm.py [--threads 1] [--waves 3] [--concurrency 16]

``benchmarks/vs_vllm.py`` compares the two *servers*; on a shared 2-core machine
their wall-clock rates also measure what the load client, the front ends and other
processes take from the engine's core (``benchmarks/serving_profile.py`` reports
that as the engine thread's run-queue wait). This compares the engines only, in
its own process, by CPU time: the ~76M random Llama of ``benchmarks/checkpoints.py``
(float32), served in waves of ``--concurrency`` requests of ``--input-len`` prompt
tokens and ``--output-len`` output tokens, greedy, EOS ignored — what the served
closed loop does, since its requests all have the same lengths and finish together.
Each wave is timed whole (prefill plus decode) and with one output token (prefill
only), alternately, and each kind's best wave is kept. Each engine runs in a child
process of its own, one after the other (in one process vLLM's CPU worker takes over
``torch.set_num_threads``); vLLM in-process there (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
with torch.compile on, as its server does. ``baton-torch`` is Baton with its attention,
RMSNorm and rotary on the pure-torch path (``engine.cpu_kernels: false``), the same-run
baseline for the C++ kernel. Prints one JSON object per line, the last with the
ratios (CPU seconds per wave, e.g. Baton over vLLM: < 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder comes first on sys.path, where benchmarks/kvtransfer.py
# would shadow the kvtransfer package the engine imports; engine.py is loaded by path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from loadgen.scripts import load_script  # noqa: E402

SIDES = ("baton", "baton-torch", "vllm")


def save_llama_100m(folder: Path) -> Any:
    """benchmarks/checkpoints.py's ~76M random Llama (what vs_vllm.py serves)."""
    return load_script(_HERE / "checkpoints.py", "bench_checkpoints").save_llama_100m(folder)


def _baton(folder: Path, cpu_kernels: bool) -> Any:
    from services.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.loader import load_model
    from services.engine.messages import EngineRequest, SamplingParams

    loaded = load_model(str(folder), dtype="float32", device="cpu")
    config = EngineConfig(
        device="cpu", max_model_len=1024, kv_cache_bytes=2**30, cpu_kernels=cpu_kernels
    )
    engine = LLMEngine(loaded, config)
    count = iter(range(1 << 30))

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            engine.add_request(EngineRequest(f"r{next(count)}", tuple(p), sampling))
        while engine.has_unfinished():
            engine.step()

    return run


def _vllm(folder: Path) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # torch.set_num_threads decides
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", max_model_len=1024, seed=0)

    def run(prompts: list[list[int]], max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)

    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--waves", type=int, default=3, help="timed waves of each kind per side")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="engines to run, in order (baton-torch: Baton with torch ops for its C++ kernels)",
    )
    args = p.parse_args(argv)

    if args.side is not None:
        _child(args)
        return
    folder = Path(tempfile.mkdtemp(prefix="baton-engine-vs-vllm-")) / "llama-76m"
    save_llama_100m(folder)
    best: dict[tuple[str, int], float] = {}
    sides = args.sides.split(",")
    for side in sides:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])]
        cmd += ["--side", side, "--model-dir", str(folder)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        best[(side, 1)], best[(side, args.output_len)] = row["prefill_cpu_s"], row["wave_cpu_s"]
        print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"summary": "CPU time per wave, best wave of each; < 1 is faster"}
    for a, b in (("baton", "vllm"), ("baton-torch", "vllm"), ("baton", "baton-torch")):
        if a in sides and b in sides:
            name = f"{a}_over_{b}".replace("-", "_")
            wave = best[(a, args.output_len)] / best[(b, args.output_len)]
            summary[f"{name}_wave"] = round(wave, 3)
            summary[f"{name}_prefill"] = round(best[(a, 1)] / best[(b, 1)], 3)
    summary["load_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(summary), flush=True)


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    folder = Path(args.model_dir)
    if args.side == "vllm":
        run = _vllm(folder)
    else:
        run = _baton(folder, cpu_kernels=args.side == "baton")
    g = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        shape = (args.concurrency, args.input_len)
        return torch.randint(3, 31990, shape, generator=g).tolist()  # type: ignore[no-any-return]

    run(prompts(), 2)  # warm-up: first calls allocate (and vLLM's compile)
    run(prompts(), 2)
    best: dict[int, float] = {}
    for _ in range(args.waves):
        for max_tokens in (1, args.output_len):
            batch = prompts()  # fresh prompts: no prefix-cache hits on either side
            start_s = time.process_time()
            run(batch, max_tokens)
            cpu_s = time.process_time() - start_s
            best[max_tokens] = min(best.get(max_tokens, float("inf")), cpu_s)
    wave_s, prefill_s = best[args.output_len], best[1]
    row = {
        "engine": args.side,
        "threads": torch.get_num_threads(),
        "wave_cpu_s": round(wave_s, 3),
        "prefill_cpu_s": round(prefill_s, 3),
        "decode_step_cpu_ms": round(1e3 * (wave_s - prefill_s) / (args.output_len - 1), 2),
        "output_tokens_per_cpu_s": round(args.concurrency * args.output_len / wave_s, 1),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
