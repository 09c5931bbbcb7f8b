"""Writing a run's folder and printing its tables.

A run folder holds ``summary.json``, ``requests.jsonl`` (one record a line)
and PNG plots; a sweep folder holds one run folder per point plus
``sweep.json`` and ``attainment_vs_rate.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.metrics import RequestRecord
from loadgen.plots import plot_attainment_vs_rate, plot_latency_cdfs, plot_over_time

__all__ = [
    "TABLE_KEYS",
    "UNITS",
    "compare_table",
    "format_table",
    "load_summary",
    "write_run",
    "write_sweep",
]

TABLE_KEYS = (
    "completed",
    "failed",
    "rejected",  # of the failed: refused (429/503), not broken
    "p99_rejection_ms",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "slo_attainment",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)


def write_run(
    out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord], plots: bool = True
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    with (out_dir / "requests.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")
    if plots:
        plot_latency_cdfs(records, out_dir / "latency_cdf.png")
        plot_over_time(records, out_dir / "latency_over_time.png")
    return out_dir


def write_sweep(out_dir: Path, summaries: Sequence[dict[str, Any]], label: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(
        json.dumps(list(summaries), indent=2, sort_keys=True) + "\n"
    )
    plot_attainment_vs_rate({label: summaries}, out_dir / "attainment_vs_rate.png")
    return out_dir


def load_summary(path: Path) -> dict[str, Any]:
    file = path / "summary.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no summary.json in {path}")
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def _fmt(value: Any) -> str:
    match value:
        case None:
            return "-"
        case bool():
            return str(value)
        case int():
            return str(value)
        case float() if math.isfinite(value):
            return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.4f}"
        case _:
            return str(value)


# The printed tables' units where the key (vLLM's name, kept in summary.json) has none.
UNITS = {
    "duration": "s",
    "request_throughput": "req/s",
    "output_throughput": "tok/s",
    "total_token_throughput": "tok/s",
    "request_goodput": "req/s",
    "slo_attainment": "share",
}


def _label(key: str) -> str:
    unit = UNITS.get(key)
    return f"{key} ({unit})" if unit else key


def format_table(summary: dict[str, Any], title: str = "Result") -> str:
    rows = [(_label(k), _fmt(summary.get(k))) for k in TABLE_KEYS if k in summary]
    width = max(len(k) for k, _ in rows)
    lines = [f"{'=' * 12} {title} {'=' * 12}"]
    lines += [f"{k:<{width}}  {v:>14}" for k, v in rows]
    return "\n".join(lines)


def compare_table(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    """Two summaries side by side with B/A ratios."""
    keys = [k for k in TABLE_KEYS if k in a or k in b]
    width = max(len(_label(k)) for k in keys)
    lines = [f"{'metric':<{width}}  {names[0]:>14}  {names[1]:>14}  {'B/A':>8}"]
    for k in keys:
        va, vb = a.get(k), b.get(k)
        ratio = "-"
        if isinstance(va, int | float) and isinstance(vb, int | float) and va:
            ratio = f"{vb / va:.3f}"
        lines.append(f"{_label(k):<{width}}  {_fmt(va):>14}  {_fmt(vb):>14}  {ratio:>8}")
    return "\n".join(lines)
