"""PNG plots with matplotlib's Agg canvas (no display, no pyplot global state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadgen.metrics import RequestRecord, request_tpot_s

__all__ = ["plot_attainment_vs_rate", "plot_latency_cdfs", "plot_over_time"]


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_latency_cdfs(records: Sequence[RequestRecord], path: Path) -> Path:
    ok = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [request_tpot_s(r) for r in ok if r.output_tokens > 1],
        "ITL": [g for r in ok for g in r.itl_s],
        "E2E latency": [r.e2el_s for r in ok if r.e2el_s is not None],
    }
    fig = Figure(figsize=(10, 7))
    for i, (name, values) in enumerate(series.items()):
        ax = fig.add_subplot(2, 2, i + 1)
        if values:
            v = np.sort(np.asarray(values, dtype=float)) * 1000
            ax.plot(v, np.arange(1, v.size + 1) / v.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_over_time(records: Sequence[RequestRecord], path: Path) -> Path:
    ok = [r for r in records if r.success and r.ttft_s is not None]
    fig = Figure(figsize=(10, 4))
    for i, (name, values) in enumerate(
        (("TTFT", [r.ttft_s for r in ok]), ("TPOT", [request_tpot_s(r) for r in ok]))
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.scatter([r.start_s for r in ok], np.asarray(values, dtype=float) * 1000, s=4)
        ax.set_xlabel("send time (s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_attainment_vs_rate(
    curves: Mapping[str, Sequence[dict[str, Any]]], path: Path, title: str = ""
) -> Path:
    """One line per label over summaries of a rate sweep: attainment and goodput vs rate."""
    fig = Figure(figsize=(11, 4))
    ax_att, ax_good = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for label, summaries in curves.items():
        points = sorted(
            ((rate, s) for s in summaries if (rate := _rate(s)) is not None), key=lambda p: p[0]
        )
        rates = [p[0] for p in points]
        ax_att.plot(
            rates, [p[1].get("slo_attainment") or 0.0 for p in points], marker="o", label=label
        )
        ax_good.plot(
            rates, [p[1].get("request_goodput") or 0.0 for p in points], marker="o", label=label
        )
    ax_att.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax_att.set_xlabel("request rate (req/s)")
    ax_att.set_ylabel("SLO attainment")
    ax_good.set_xlabel("request rate (req/s)")
    ax_good.set_ylabel("goodput (req/s)")
    for ax in (ax_att, ax_good):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _rate(summary: dict[str, Any]) -> float | None:
    try:
        return float(summary.get("rate") or "nan") if summary.get("rate") != "inf" else None
    except ValueError:
        return None
