"""Goodput past saturation, live: ``baton serve`` (2 prefill + 2 decode) swept to its
saturation rate, then offered 2x and 3x that rate (loadgen/overload.py).

    python benchmarks/overload.py [--model medium|small|tiny|DIR] [--policy slo_goodput]
        [--rates auto|4,8,12,16] [--start-rate auto|1] [--duration 30] [--over-duration S]
        [--refine-steps 2] [--warm-up-rate 1] [--warm-up-s 10] [--slo-scale auto]
        [--rebalance]

One JSON object per line: each run's row, then a summary with each factor's goodput as
a fraction of the peak (target: >= 0.9) and its slowest refusal (target: < 50 ms on
the reference host, scaled by the host's slowdown like the SLO: ``refusal_bound_ms``). A
run's goodput is ``window_goodput``: good requests sent in its window per second of it
(``request_goodput``, vLLM's, to the last answer, is in each row too).

``--model medium`` (the default) is a random 53M-parameter Llama (hidden 768, 8 layers)
built in a temporary folder: its workers' compute, not the gateway's and the load
generator's per-request HTTP work, sets the saturation rate (about 9 req/s on 2 AVX-512
cores; 2-3 req/s on 2 AVX2 cores), as on GPUs. ``--rates auto`` (the default) climbs
from ``--start-rate`` by 1.5x a run until one run is past saturation, so the sweep
finds the knee of whatever machine it runs on, and ``--refine-steps`` runs narrow it
between the last rate served and the next. ``--start-rate auto`` (the default)
starts at ``AUTO_START_RPS`` divided by the host's slowdown (the one the SLO is scaled
by): about 45% of the saturation rate, on any host, so the sweep spends no run far
below the knee (from 1 req/s on the reference host it ran 1, 1.5 and 2.25 req/s first,
a third of the sweep's time, for rows that only show an idle cluster). ``small`` (15M, hidden 384, 6 layers)
saturates near 30 req/s on the AVX-512 machine, where 3x is ~90 req/s of HTTP from a
client on the same 2 cores as the engines: that measures the box (3x held 0.85-0.92 of
peak), not admission. ``tiny`` saturates near 40 req/s there.
The rebalancer is off unless ``--rebalance``: this measures admission on a fixed split.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

_HERE = Path(__file__).resolve().parent
# Run as a script, this folder comes first on sys.path, and benchmarks/kvtransfer.py
# would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from loadgen.client import BenchConfig  # noqa: E402
from loadgen.flags import above_zero  # noqa: E402
from loadgen.host_speed import measure_slowdown  # noqa: E402
from loadgen.metrics import GoodputSLO  # noqa: E402
from loadgen.overload import OverloadConfig, run_overload  # noqa: E402
from loadgen.scenario import WorkloadConfig  # noqa: E402
from loadgen.scripts import load_script  # noqa: E402
from loadgen.server_proc import baton_serving  # noqa: E402
from services.heap import freeze_startup_heap  # noqa: E402

SLO = GoodputSLO(ttft_ms=2000, tpot_ms=200)
# ``--start-rate auto``'s first rate on the reference host (2 AVX-512 cores, where the
# medium model saturates near 7.6 req/s): 1.5^3, so the sweep's rates there are those
# the climb from 1 req/s reached, without its first three runs.
AUTO_START_RPS = 3.375
# Every refusal answered within this on the reference host (issue: "< 50 ms"). Like the
# SLO's targets it is scaled by the host's measured slowdown: a refusal is the gateway's
# and the client's Python work on the same cores as the engines. On a host 1.5x slower
# than the reference (a CI run: saturation 5.06 against 7.59 req/s), refusals took p99
# 37-58 ms and at most 63.5 ms at every rate past saturation, the peak's included.
REFUSAL_MS = 50.0
WORKLOAD = WorkloadConfig(input_len="lognormal:mean=200,sigma=0.8", output_len="48", seed=1)


def save_small_llama(folder: Path) -> Path:
    """A random 15M-parameter Llama (hidden 384, 6 layers, 6/2 heads, vocab 4096)."""
    load_script(_HERE / "checkpoints.py", "bench_checkpoints").save_random_llama(
        folder, 4096, 384, 1024, 6, 6, 2
    )
    return folder


def save_medium_llama(folder: Path) -> Path:
    """A random 53M-parameter Llama (hidden 768, 8 layers, 12/4 heads, vocab 4096)."""
    load_script(_HERE / "checkpoints.py", "bench_checkpoints").save_random_llama(
        folder, 4096, 768, 2048, 8, 12, 4
    )
    return folder


def serve_config(
    policy: str, rebalance: bool, max_hold_s: float, slo: GoodputSLO = SLO
) -> dict[str, object]:
    return {
        "engine": {"device": "cpu", "num_threads": 1, "kv_cache_bytes": 64 * 2**20},
        # The engines yield the CPU to the gateway (and the client) they share it with,
        # and decode engines yield it to prefill ones: a slow prefill step makes every
        # prompt in it late at once (``workers.prefill_nice``).
        "workers": {
            "mode": "disaggregated",
            "prefill": 2,
            "decode": 2,
            "nice": 10,
            "prefill_nice": 5,
        },
        "kvtransfer": {"backend": "nixl"},
        "router": {
            "policy": policy,
            "default_slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "rebalance_interval_s": 10.0 if rebalance else 3600.0,
            "max_hold_s": max_hold_s,
        },
    }


def measure(args: argparse.Namespace, work: Path) -> dict[str, object]:
    model = args.model
    if model in ("small", "medium"):
        save = save_small_llama if model == "small" else save_medium_llama
        model = str(save(work / f"{model}-llama"))
    slowdown = host_slowdown(args.slo_scale, work)
    slo = SLO.scaled(slowdown)
    start_rate = first_sweep_rate(args.start_rate, slowdown)
    config_path = work / "overload.yaml"
    serve = serve_config(args.policy, args.rebalance, args.max_hold, slo)
    config_path.write_text(yaml.safe_dump(serve))
    serve_args = ["--config", str(config_path), "--model", model, "--log-level", "warning"]
    with baton_serving(serve_args, timeout_s=300) as url:
        tokenizer = None
        if model != "tiny":
            from services.engine.loader import load_tokenizer

            tokenizer = load_tokenizer(model)
        config = OverloadConfig(
            base_url=url,
            workload=WORKLOAD,
            slo=slo,
            rates=[] if args.rates == "auto" else [float(r) for r in args.rates.split(",")],
            start_rate=start_rate,
            warm_up_rate=args.warm_up_rate,
            warm_up_s=args.warm_up_s,
            duration_s=args.duration,
            over_duration_s=args.over_duration,
            repeats=args.repeats,
            refine_steps=args.refine_steps,
            bench=BenchConfig(url, tokenizer=tokenizer),
        )
        freeze_startup_heap()  # the client's full collections would delay the answers it times
        result = run_overload(config, report=lambda row: print(json.dumps(row), flush=True))
    return result | {
        "slo_ms": {"ttft": slo.ttft_ms, "tpot": slo.tpot_ms},
        "refusal_bound_ms": refusal_bound_ms(slowdown),
        "host_slowdown": slowdown,
        "start_rate": start_rate,
    }


def host_slowdown(scale: str, work: Path) -> float:
    """What the SLO's targets are multiplied by and the automatic start rate divided by:
    ``scale``, or for ``auto`` this host's slowdown against the machine the targets were
    set on (``loadgen.host_speed``, measured here on the small model). Unscaled on 2 AVX2
    cores, the prompts' tail could not meet the TTFT target on an idle cluster: 15% of a
    1 req/s run was refused, and the sweep stopped there."""
    if scale == "auto":
        return measure_slowdown(save_small_llama(work / "small-llama-speed"))
    return float(scale)


def refusal_bound_ms(slowdown: float) -> float:
    """The slowest refusal allowed, ms: ``REFUSAL_MS`` times the host's slowdown, never
    below ``REFUSAL_MS`` (a faster host than the reference is held to the issue's 50 ms)."""
    return REFUSAL_MS * max(1.0, slowdown)


def first_sweep_rate(start_rate: float | str, slowdown: float) -> float:
    """The climbing sweep's first rate, requests/s: ``start_rate``, or for ``auto``
    ``AUTO_START_RPS`` over the host's slowdown (the knee moves with the host's speed)."""
    return AUTO_START_RPS / slowdown if start_rate == "auto" else float(start_rate)


def rate_or_auto(text: str) -> float | str:
    """``--start-rate``'s value: ``auto`` or a rate above 0 (requests/s)."""
    return text if text == "auto" else above_zero("auto or requests/s")(text)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (``tests/e2e/test_overload_live.py`` parses its own)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="medium", help="medium, small, tiny, or a local model folder")
    p.add_argument("--policy", default="slo_goodput")
    p.add_argument("--rates", default="auto", help="sweep, requests/s; auto: climb to the knee")
    p.add_argument(
        "--start-rate",
        type=rate_or_auto,
        default="auto",
        help="the climbing sweep's first rate, requests/s; auto: AUTO_START_RPS over the "
        "host's slowdown (about 45%% of the saturation rate)",
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    p.add_argument(
        "--over-duration",
        type=float,
        help="seconds of arrivals per overloaded run (default: --duration)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        choices=range(1, 11),
        metavar="N",
        default=3,
        help="runs at the peak's rate and at each factor, in rounds, each round on arrivals "
        "of its own; each one's goodput is the mean of its runs (one 30 s run swings by a "
        "tenth or more)",
    )
    p.add_argument(
        "--refine-steps",
        type=int,
        choices=range(0, 6),
        metavar="N",
        default=2,
        help="runs after the climb that halve, in log scale, the gap between the highest "
        "rate served and the next (2: the saturation rate within 1.5^(1/4), 11%%)",
    )
    p.add_argument(
        "--warm-up-rate",
        type=float,
        default=1.0,
        help="requests/s of an uncounted first run (0: none)",
    )
    p.add_argument("--warm-up-s", type=float, default=10.0, help="seconds of the warm-up run")
    p.add_argument(
        "--slo-scale",
        default="auto",
        help="multiply the SLO's targets by this; auto: this host's slowdown (loadgen.host_speed)",
    )
    p.add_argument("--rebalance", action="store_true", help="let the ratio planner flip roles")
    p.add_argument(
        "--max-hold",
        type=float,
        default=0.0,
        help="router.max_hold_s (0, the default: refuse at once; a held request that finds "
        "no room is refused when its hold runs out, up to 1.8 s on 2 AVX-512 cores at 5 s)",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-overload-") as tmp:
        result = measure(args, Path(tmp))
    over = result["over"]
    assert isinstance(over, list)
    print(
        json.dumps(
            {
                "benchmark": "overload",
                "model": args.model,
                "policy": args.policy,
                "rebalance": args.rebalance,
                "max_hold_s": args.max_hold,
                "repeats": args.repeats,
                "refine_steps": args.refine_steps,
                "slo_ms": result["slo_ms"],
                "refusal_bound_ms": result["refusal_bound_ms"],
                "peak_goodput_req_per_s": result["peak_goodput"],
                "saturation_rate_req_per_s": result["saturation_rate"],
                **{f"goodput_of_peak_at_{r['factor']:g}x": r["of_peak"] for r in over},
                **{f"max_rejection_ms_at_{r['factor']:g}x": r["max_rejection_ms"] for r in over},
                "load_average_1m": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
