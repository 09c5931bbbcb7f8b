"""Per-request records -> the summary, with vLLM ``bench serve`` names and units.

Definitions (times in the summary are milliseconds, ``duration`` seconds):

* ``ttft``: first content token minus send time; ``e2el``: last byte minus send time.
* ``tpot`` per request: ``(e2el - ttft) / (output_tokens - 1)``, the first token
  excluded; the TPOT statistics cover only requests with more than one token,
  while for goodput a request with <= 1 token has TPOT 0.
* ``itl``: every gap between consecutive content events, pooled over requests.
* Goodput (``--goodput ttft:MS tpot:MS e2el:MS``): a completed request is good
  only if every given target holds (measured <= target); failed requests never
  count; ``request_goodput = good / duration`` and is ``None`` without an SLO.
* ``slo_attainment``: good / (completed + failed), so failures and rejections
  lower it (a share, not a rate; ``None`` without an SLO).

Statistics over an empty set are 0, as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadgen.workload import WorkloadError

__all__ = [
    "PERCENTILES",
    "GoodputSLO",
    "RequestRecord",
    "compute_summary",
    "parse_goodput",
    "request_tpot_s",
]

PERCENTILES = (90, 99)
_SLO_KEYS = ("ttft", "tpot", "e2el")
_REFUSED = (429, 503)  # overload answers: Too Many Requests, Service Unavailable


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    success: bool
    start_s: float  # send time, seconds from the run start
    ttft_s: float | None = None
    e2el_s: float | None = None  # a failed request's: until its error answer, if any
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: int | None = None  # HTTP status, None when no response came
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "success": self.success,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "tpot_s": request_tpot_s(self) if self.success else None,
            "e2el_s": self.e2el_s,
            "itl_s": list(self.itl_s),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "status": self.status,
            "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class GoodputSLO:
    """Targets in milliseconds; ``None`` means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        items = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return {k: v for k, v in items if v is not None}

    def scaled(self, factor: float) -> GoodputSLO:
        """Every set target times ``factor`` (a slower host's targets, say)."""
        return GoodputSLO(**{f"{k}_ms": v * factor for k, v in self.as_dict().items()})

    def is_good(self, record: RequestRecord) -> bool:
        if not record.success or record.ttft_s is None or record.e2el_s is None:
            return False
        measured_ms = {
            "ttft": record.ttft_s * 1000,
            "tpot": request_tpot_s(record) * 1000,
            "e2el": record.e2el_s * 1000,
        }
        return all(measured_ms[k] <= target for k, target in self.as_dict().items())


def parse_goodput(items: Sequence[str]) -> GoodputSLO | None:
    """``["ttft:200", "tpot:50"]`` -> ``GoodputSLO(200, 50)``; ``[]`` -> ``None``."""
    targets: dict[str, float] = {}
    for item in items:
        for part in item.replace(",", " ").split():
            key, colon, value = part.partition(":")
            if not colon or key not in _SLO_KEYS:
                raise WorkloadError(
                    f"bad --goodput item {part!r}: expected KEY:MS with KEY in {', '.join(_SLO_KEYS)}"
                )
            try:
                targets[key] = float(value)
            except ValueError:
                raise WorkloadError(
                    f"bad --goodput item {part!r}: {value!r} is not a number"
                ) from None
            if targets[key] < 0:
                raise WorkloadError(f"bad --goodput item {part!r}: must be >= 0")
    if not targets:
        return None
    return GoodputSLO(targets.get("ttft"), targets.get("tpot"), targets.get("e2el"))


def request_tpot_s(record: RequestRecord) -> float:
    if record.output_tokens <= 1 or record.ttft_s is None or record.e2el_s is None:
        return 0.0
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class _Weighted:
    """ITL samples with weights (the simulator pools equal step gaps instead of listing them)."""

    values_s: np.ndarray
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


def compute_summary(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: GoodputSLO | None = None,
    itl_override: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The summary dict (the ``summary.json`` body, without run metadata).

    ``itl_override``: (gap seconds, weight) pairs replacing the records' ITLs.
    """
    ok = [r for r in records if r.success]
    duration = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slo is None:
        out["request_goodput"] = None
        out["slo_attainment"] = None
    else:
        good = sum(1 for r in ok if slo.is_good(r))
        out["request_goodput"] = good / duration
        out["slo_attainment"] = good / len(records) if records else 0.0
    out["goodput_slo_ms"] = slo.as_dict() if slo else None
    # Refusals (429/503) beside goodput: how many, and how fast they were answered.
    refused_ms = [r.e2el_s * 1000 for r in records if r.status in _REFUSED and r.e2el_s is not None]
    out["rejected"] = len(refused_ms)
    out["p99_rejection_ms"] = float(np.percentile(refused_ms, 99)) if refused_ms else 0.0
    out["max_rejection_ms"] = max(refused_ms, default=0.0)
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None])
    tpot = np.array([request_tpot_s(r) for r in ok if r.output_tokens > 1])
    e2el = np.array([r.e2el_s for r in ok if r.e2el_s is not None])
    if itl_override is None:
        itl = _Weighted(np.array([g for r in ok for g in r.itl_s]))
    else:
        itl = _Weighted(*itl_override)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        out.update(_stats(name, _Weighted(values)))
    out.update(_stats("itl", itl))
    return out


def _stats(name: str, data: _Weighted) -> dict[str, float]:
    values_ms = data.values_s * 1000.0
    weights = data.weights if data.weights.size else np.ones_like(values_ms)
    keep = weights > 0
    values_ms, weights = values_ms[keep], weights[keep]
    if values_ms.size == 0:
        zeros = {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std")}
        return zeros | {f"p{p}_{name}_ms": 0.0 for p in PERCENTILES}
    mean = float(np.average(values_ms, weights=weights))
    std = float(np.sqrt(np.average((values_ms - mean) ** 2, weights=weights)))
    return {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": _percentile(values_ms, weights, 50),
        f"std_{name}_ms": std,
    } | {f"p{p}_{name}_ms": _percentile(values_ms, weights, p) for p in PERCENTILES}


def _percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    if np.all(weights == 1):
        return float(np.percentile(values, q))  # numpy's linear interpolation, as vLLM
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    idx = int(np.searchsorted(cum, q / 100.0 * cum[-1], side="left"))
    return float(v[min(idx, v.size - 1)])
