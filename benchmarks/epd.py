"""E/P/D against encode-colocated on an image-heavy workload, in the simulator.

Bursts of multi-image requests (``--burstiness`` < 1: gamma arrivals) mixed with text
chat, on the same number of simulated GPUs two ways:

* ``epd``: a quarter of the GPUs encode, a quarter prefill, half decode;
* ``encode_colocated``: half prefill (each encoding its own requests' images), half decode.

Both run the real router (``slo_goodput``) and the shipped profile
``loadgen/profiles/internvl2-26b-h100.json`` (InternViT-6B encoder + InternLM2-20B;
published sizes, roofline-estimated, sources in the file). For each layout and cluster
size it sweeps the request rate and reports the p90 TTFT at every rate and the goodput
at 90% attainment: the highest swept rate whose SLO attainment is at least 90%, with
the goodput measured there. One JSON object on stdout; ratios are within this run.

    python benchmarks/epd.py                       # 16 and 64 GPUs
    python benchmarks/epd.py --gpus 16 --num-requests 1500

Not built: the live half (the tiny cluster, text-only p90 TTFT during image bursts).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder leads sys.path and benchmarks/router.py would shadow the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

from loadgen.arrivals import RateSpec  # noqa: E402
from loadgen.metrics import GoodputSLO  # noqa: E402
from loadgen.scenario import WorkloadConfig  # noqa: E402
from loadgen.sim.profile import load_profile  # noqa: E402
from loadgen.sim.run import SimConfig, simulate  # noqa: E402

PROFILE = "internvl2-26b-h100"
IMAGE_TOKENS = 256  # InternVL2: one 448x448 tile -> 256 image tokens
SLO = GoodputSLO(ttft_ms=1500, tpot_ms=100)
ATTAINMENT = 0.9


def layouts(gpus: int) -> dict[str, dict[str, int]]:
    quarter = gpus // 4
    return {
        "epd": {"num_encode": quarter, "num_prefill": quarter, "num_decode": gpus - 2 * quarter},
        "encode_colocated": {"num_prefill": gpus // 2, "num_decode": gpus - gpus // 2},
    }


def workload(num_requests: int, seed: int, burstiness: float) -> WorkloadConfig:
    return WorkloadConfig(
        input_len="uniform:64-512",
        output_len="uniform:32-256",
        num_requests=num_requests,
        burstiness=burstiness,
        seed=seed,
        images_per_request="uniform:2-8",
        image_size="448",
        image_fraction=0.5,
    )


def run_layout(
    layout: dict[str, int], rates: list[float], base: WorkloadConfig
) -> list[dict[str, Any]]:
    profile = load_profile(PROFILE)
    rows = []
    for rps in rates:
        config = SimConfig(
            workload=base,
            rate=RateSpec(rps),
            profile=profile,
            policy="slo_goodput",
            slo=SLO,
            image_tokens_per_image=IMAGE_TOKENS,
            rebalance=False,  # same layout throughout: the comparison is of layouts
            **layout,
        )
        s = simulate(config).summary
        rows.append(
            {
                "rate_rps": rps,
                "p90_ttft_ms": s["p90_ttft_ms"],
                "slo_attainment": s["slo_attainment"],
                "request_goodput": s["request_goodput"],
                "rejected": s["rejected"],
            }
        )
    return rows


def goodput_at_attainment(rows: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in rows if r["slo_attainment"] >= ATTAINMENT]
    if not good:
        return {"rate_rps": None, "request_goodput": 0.0, "p90_ttft_ms": None}
    best = max(good, key=lambda r: r["rate_rps"])
    return {k: best[k] for k in ("rate_rps", "request_goodput", "p90_ttft_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--burstiness", type=float, default=0.25)
    parser.add_argument("--rates-per-gpu", type=float, nargs="+", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    per_gpu = args.rates_per_gpu or [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5]
    started_cpu = time.process_time()
    out: dict[str, Any] = {
        "profile": PROFILE,
        "slo_ms": SLO.as_dict(),
        "attainment": ATTAINMENT,
        "image_tokens_per_image": IMAGE_TOKENS,
        "results": {},
    }
    for gpus in args.gpus:
        base = workload(args.num_requests, args.seed, args.burstiness)
        rates = [round(r * gpus, 3) for r in per_gpu]
        entry: dict[str, Any] = {}
        for name, layout in layouts(gpus).items():
            rows = run_layout(layout, rates, replace(base))
            entry[name] = {
                "layout": layout,
                "sweep": rows,
                "at_90": goodput_at_attainment(rows),
            }
        epd, coloc = entry["epd"]["at_90"], entry["encode_colocated"]["at_90"]
        entry["goodput_ratio_epd_over_colocated"] = (
            epd["request_goodput"] / coloc["request_goodput"] if coloc["request_goodput"] else None
        )
        out["results"][str(gpus)] = entry
    out["sim_cpu_s"] = time.process_time() - started_cpu
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
