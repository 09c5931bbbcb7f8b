"""``benchmarks/epd.py --live``: E/P/D against encode-colocated on the tiny cluster.

``baton serve`` with ``tiny-vl`` (or ``--live-model``, a LLaVA folder) on CPU, 1 encode +
1 prefill + 1 decode worker against 2 prefill + 1 decode (the prefill workers encode),
each served once and loaded at each ``--rate`` in turn with seeded open-loop traces
(``benchmarks/epd.py``'s workload, shorter and with 336 px images); see that file's
docstring. Loaded by its ``main``, which parses the options; not run on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO
from loadgen.scripts import load_script

_epd = load_script(Path(__file__).resolve().with_name("epd.py"), "bench_epd")

LIVE_SLO = GoodputSLO(ttft_ms=2000, tpot_ms=200)
LIVE_LAYOUTS = {
    "epd": {"encode": 1, "prefill": 1, "decode": 1},
    "encode_colocated": {"encode": 0, "prefill": 2, "decode": 1},
}


def _serve_args(name: str, layout: dict[str, int], folder: Path, model: str) -> list[str]:
    """``baton serve``'s arguments for ``layout`` serving ``model`` (its config written to
    ``folder``)."""
    config = {
        "model": {"name": model},
        "engine": {"device": "cpu", "num_threads": 1, "block_size": 4},
        "workers": {"mode": "disaggregated", "mixed": 0, "num_cpus": 0, **layout},
        "kvtransfer": {"backend": "nixl"},
        "router": {"policy": "slo_goodput"},
        "gateway": {"host": "127.0.0.1"},
    }
    path = folder / f"serve-{name}.json"  # JSON is YAML
    path.write_text(json.dumps(config))
    return ["serve", "--config", str(path)]


def live(args: argparse.Namespace) -> dict[str, Any]:
    """Each layout served once and loaded at each rate in turn (ascending), the same
    trace shape at every rate but a new seed per rate (a repeated trace would hit the
    encoder-output and prefix caches); both layouts get the same traces."""
    from loadgen.client import BenchConfig, run_bench
    from loadgen.metrics import compute_summary
    from loadgen.scenario import build_requests
    from loadgen.server_proc import start_baton, stop  # imports torch

    rates = sorted(args.rate)
    traces = [
        replace(
            _epd.workload(args.num_requests, args.seed + i, args.burstiness),
            input_len="uniform:16-64",
            output_len="uniform:8-24",
            image_size="336",
        )
        for i in range(len(rates))
    ]
    model = args.live_model
    tokenizer = None
    if model != "tiny-vl":
        from loadgen.cli_bench import load_tokenizer_folder

        tokenizer = load_tokenizer_folder(model)
    out: dict[str, Any] = {"model": model, "slo_ms": LIVE_SLO.as_dict(), "rates": rates}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LIVE_LAYOUTS.items():
            proc, url = start_baton(_serve_args(name, layout, Path(tmp), model), timeout_s=300.0)
            rows = []
            try:
                for rps, base in zip(rates, traces, strict=True):
                    load_before = os.getloadavg()[0]
                    config = BenchConfig(
                        url, base, RateSpec(rps), endpoint="chat", slo=LIVE_SLO, tokenizer=tokenizer
                    )
                    result = run_bench(config)
                    images = {
                        s.request_id for s in build_requests(base, RateSpec(rps)) if s.image_sides
                    }
                    text = [r for r in result.records if r.request_id not in images]
                    text_summary = compute_summary(text, 1.0, LIVE_SLO)
                    s = result.summary
                    rows.append(
                        {
                            "rate_rps": rps,
                            "p90_ttft_ms": s["p90_ttft_ms"],
                            "text_p90_ttft_ms": text_summary["p90_ttft_ms"],
                            "request_goodput": s["request_goodput"],
                            "slo_attainment": s["slo_attainment"],
                            "failed": sum(not r.success for r in result.records),
                            # Each failure's error, with how many requests had it.
                            "errors": dict(
                                Counter(r.error for r in result.records if not r.success)
                            ),
                            "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                        }
                    )
            finally:
                stop(proc, grace_s=60)
            out[name] = {"layout": layout, "sweep": rows, "at_90": _epd.goodput_at_attainment(rows)}
    return out
