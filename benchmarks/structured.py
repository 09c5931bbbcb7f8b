"""What structured outputs cost the embedded engine: TPOT with a JSON schema on every
request vs none, and the TTFT a grammar compile adds (first time, and from the cache).

Same run, same engine: 16 concurrent requests (the ``--concurrency``) stepped by one
``LLMEngine``, every request under a JSON schema; then the baseline, the same requests
unconstrained with each one's ``max_tokens`` set to the length it had constrained (so
both runs step the same batch sizes). TPOT
per request is (last token time - first token time) / (tokens - 1); the ratio compares
medians (target <= 1.05x). TTFT is ``add_request`` plus steps until the first token of
one request alone: unconstrained, with a schema never seen (a compile), and with the same
schema again (a cache hit; target < 1 ms added).

The same pair is then measured for vLLM's engine on the same model, driven through the
same Engine protocol by Baton's vLLM backend (vLLM's own xgrammar path), side by side:
one JSON line per engine. The default model is a small random Llama built here with a
byte-level BPE tokenizer (JSON needs byte tokens; vLLM's CPU attention needs head_dim 64).

Usage: ``python benchmarks/structured.py [--model DIR|tiny] [--concurrency 16]
[--max-tokens 64] [--skip-vllm]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
            "maxItems": 8,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def _engine(model: str, backend: str = "embedded") -> Any:
    from services.backends import make_engine
    from services.config import EngineConfig, ModelConfig

    cfg = EngineConfig.model_validate(
        {"device": "cpu", "num_threads": 1, "max_model_len": 1024}
        | ({"vllm": {"enforce_eager": True}} if backend == "vllm" else {})
    )
    return make_engine(backend, ModelConfig(name=model, dtype="float32"), cfg)


def build_model(folder: Path) -> Path:
    """A ~5M-parameter random Llama (head_dim 64) with a 512-token byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [
        json.dumps({"items": [{"name": f"item{i}{j}", "qty": i * j} for j in range(i % 5)]})
        + f" order {i}: list the items as JSON, please."
        for i in range(400)
    ]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).float().save_pretrained(str(folder))
    return folder


def _run(engine: Any, max_tokens: list[int], structured: Any) -> tuple[list[float], list[int]]:
    """TPOT and number of tokens of each request, in order."""
    from services.engine.messages import EngineRequest, SamplingParams

    ids = []
    for i, limit in enumerate(max_tokens):
        params = SamplingParams(
            max_tokens=limit,
            temperature=1.0,
            seed=i,
            ignore_eos=structured is None,
            structured=structured,
        )
        prompt = tuple(engine.encode(f"order {i}: list the items as JSON"))
        ids.append(f"r{i}-{time.perf_counter_ns()}")
        engine.add_request(EngineRequest(ids[-1], prompt, params))
    times: dict[str, list[float]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
    tpots = [(times[r][-1] - times[r][0]) / max(1, len(times[r]) - 1) for r in ids]
    return tpots, [len(times[r]) for r in ids]


def _ttft_s(engine: Any, structured: Any) -> float:
    from services.engine.messages import EngineRequest, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, structured=structured)
    start = time.perf_counter()
    engine.add_request(EngineRequest(f"t{time.perf_counter_ns()}", (1, 2, 3, 4), params))
    while not any(o.new_token_ids for o in engine.step()):
        pass
    return time.perf_counter() - start


def measure(engine: Any, label: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from services.engine.messages import StructuredOutput

    schema = StructuredOutput("json", json.dumps(SCHEMA))
    _run(engine, [8] * args.concurrency, schema)  # warm up (and compile)
    plain: list[float] = []
    constrained: list[float] = []
    for _ in range(args.rounds):  # interleaved, so drift hits both alike
        tpots, lengths = _run(engine, [args.max_tokens] * args.concurrency, schema)
        constrained += [t for t, n in zip(tpots, lengths) if n > 2]
        # The baseline runs the same lengths unconstrained: the same batch at every step.
        tpots, _ = _run(engine, lengths, None)
        plain += [t for t, n in zip(tpots, lengths) if n > 2]
    ttft_plain = statistics.median(_ttft_s(engine, None) for _ in range(20))
    first: list[float] = []
    cached: list[float] = []
    for i in range(10):
        fresh = dict(SCHEMA, title=f"bench-{i}-{time.perf_counter_ns()}")  # never compiled
        spec = StructuredOutput("json", json.dumps(fresh))
        first.append(_ttft_s(engine, spec))
        cached.append(_ttft_s(engine, spec))
    tpot_plain = statistics.median(plain)
    tpot_json = statistics.median(constrained)
    return {
        "bench": "structured",
        "engine": label,
        "model": model,
        "concurrency": args.concurrency,
        "baseline_tpot_ms": round(tpot_plain * 1e3, 4),
        "json_schema_tpot_ms": round(tpot_json * 1e3, 4),
        "tpot_ratio": round(tpot_json / tpot_plain, 3),
        "tpot_ratio_target": 1.05,
        "baseline_ttft_ms": round(ttft_plain * 1e3, 3),
        "first_compile_added_ttft_ms": round((statistics.median(first) - ttft_plain) * 1e3, 3),
        "cached_added_ttft_ms": round((statistics.median(cached) - ttft_plain) * 1e3, 3),
        "cached_added_ttft_target_ms": 1.0,
    }


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="a local HF folder or tiny (default: built)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    model = args.model or str(build_model(Path(tempfile.mkdtemp(prefix="baton-structured-"))))
    print(json.dumps(measure(_engine(model), "embedded", model, args)), flush=True)
    if not args.skip_vllm and model != "tiny":
        print(json.dumps(measure(_engine(model, "vllm"), "vllm", model, args)), flush=True)


if __name__ == "__main__":
    main()
