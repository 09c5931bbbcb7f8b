"""``benchmarks/epd.py``'s goodput search of one role split, in the simulator.

The simulated model (``PROFILE``, InternVL2-26B on H100s, its images tiled as
InternVL2 does) and the search: rates from 0.5 req/s per GPU up by ``ladder`` until
attainment drops under 90% (``ATTAINMENT``), then ``bisections`` halvings of the last
gap; the goodput measured at the highest rate that kept 90%
(``goodput_at_attainment``, which ``benchmarks/epd_live.py`` reads its sweeps with
too). Loaded by ``benchmarks/epd.py``; not run on its own.
"""

from __future__ import annotations

from typing import Any

from loadgen.arrivals import RateSpec
from loadgen.metrics import GoodputSLO
from loadgen.scenario import WorkloadConfig
from loadgen.sim.profile import load_profile
from loadgen.sim.run import SimConfig, simulate
from router.front_door import RouterSettings

PROFILE = "internvl2-26b-h100"
IMAGE_TOKENS = 256  # InternVL2: one 448x448 tile -> 256 image tokens
TILE_PX, MAX_TILES = 448, 12  # InternVL2's dynamic resolution (loadgen.sim.images)
ATTAINMENT = 0.9
MAX_RATE_PER_GPU = 16.0  # the search's top rate


def run_rate(
    layout: dict[str, int], rps: float, base: WorkloadConfig, length_split: str, slo: GoodputSLO
) -> dict[str, Any]:
    profile = load_profile(PROFILE)
    config = SimConfig(
        workload=base,
        rate=RateSpec(rps),
        profile=profile,
        router=RouterSettings(profile=profile, length_split=length_split),
        policy="slo_goodput",
        slo=slo,
        image_tokens_per_image=IMAGE_TOKENS,
        image_tile_px=TILE_PX,
        max_image_tiles=MAX_TILES,
        rebalance=False,  # same layout throughout: the comparison is of layouts
        num_encode=layout.get("num_encode", 0),
        num_prefill=layout["num_prefill"],
        num_decode=layout["num_decode"],
    )
    s = simulate(config).summary
    return {
        "rate_rps": rps,
        "p90_ttft_ms": s["p90_ttft_ms"],
        "slo_attainment": s["slo_attainment"],
        "request_goodput": s["request_goodput"],
        "rejected": s["rejected"],
    }


def search_layout(
    layout: dict[str, int],
    gpus: int,
    base: WorkloadConfig,
    ladder: float,
    bisections: int,
    length_split: str,
    slo: GoodputSLO,
) -> dict[str, Any]:
    """Goodput at 90% attainment of one role split: rates from 0.5/GPU up by ``ladder``
    until attainment drops under 90%, then ``bisections`` halvings (in log rate) of the
    last gap. Every split gets the same search."""
    rows: list[dict[str, Any]] = []
    low, high = None, None
    for rps in ladder_rates(gpus, ladder):
        row = run_rate(layout, round(rps, 3), base, length_split, slo)
        rows.append(row)
        if row["slo_attainment"] < ATTAINMENT:
            high = rps
            break
        low = rps
        # still at 90% at the cap (the last rate): "at_90" is a lower bound ("capped")
    if low is not None and high is not None:
        for _ in range(bisections):
            mid = (low * high) ** 0.5
            row = run_rate(layout, round(mid, 3), base, length_split, slo)
            rows.append(row)
            low, high = (mid, high) if row["slo_attainment"] >= ATTAINMENT else (low, mid)
    rows.sort(key=lambda r: r["rate_rps"])
    at_90 = goodput_at_attainment(rows)
    at_90["capped"] = high is None  # never dropped under 90%: the search's top rate held
    return {"layout": layout, "sweep": rows, "at_90": at_90}


def ladder_rates(gpus: int, ladder: float) -> list[float]:
    """The search's ladder: 0.5 req/s per GPU, times ``ladder`` each step, up to the cap."""
    rates, rps, cap = [], 0.5 * gpus, MAX_RATE_PER_GPU * gpus
    while True:
        rates.append(rps)
        if rps >= cap:
            return rates
        rps = min(rps * ladder, cap)


def goodput_at_attainment(rows: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in rows if r["slo_attainment"] >= ATTAINMENT]
    if not good:
        return {"rate_rps": None, "request_goodput": 0.0, "p90_ttft_ms": None}
    best = max(good, key=lambda r: r["rate_rps"])
    return {k: best[k] for k in ("rate_rps", "request_goodput", "p90_ttft_ms")}
