"""When requests arrive: open-loop rate processes and the rate flag's syntax.

Open loop: inter-arrival gaps are gamma distributed with shape ``burstiness``
and mean ``1/rate`` (shape 1 is Poisson; below 1 is burstier, above 1 is more
regular), the convention of vLLM's ``--burstiness``. A ramp ``ramp:R0-R1``
raises the rate linearly from R0 to R1 across the run. ``inf`` sends everything
at time 0. Closed-loop concurrency is not an arrival process: the client keeps
``concurrency`` requests in flight and ignores arrival times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from loadgen.workload import WorkloadError

__all__ = ["RateSpec", "arrival_times", "parse_rate", "parse_sweep"]


@dataclass(frozen=True, slots=True)
class RateSpec:
    start_rps: float  # math.inf: all at once
    end_rps: float | None = None  # set for a linear ramp

    @property
    def label(self) -> str:
        if self.end_rps is not None:
            return f"ramp:{self.start_rps:g}-{self.end_rps:g}"
        return "inf" if math.isinf(self.start_rps) else f"{self.start_rps:g}"

    @property
    def mean_rps(self) -> float:
        return self.start_rps if self.end_rps is None else (self.start_rps + self.end_rps) / 2


def parse_rate(text: str) -> RateSpec:
    t = text.strip().lower()
    try:
        if t.startswith("ramp:"):
            lo, _, hi = t[5:].partition("-")
            start, end = float(lo), float(hi)
            if start <= 0 or end <= 0 or math.isinf(start) or math.isinf(end):
                raise WorkloadError(f"bad rate {text!r}: ramp ends must be finite and > 0")
            return RateSpec(start, end)
        rate = float(t)
    except ValueError:
        raise WorkloadError(f"bad rate {text!r}: expected a number, 'inf' or ramp:R0-R1") from None
    if rate <= 0:
        raise WorkloadError(f"bad rate {text!r}: must be > 0")
    return RateSpec(rate)


def parse_sweep(text: str) -> list[str]:
    """``"1,2,4"`` -> ``["1", "2", "4"]``; a comma list is a sweep."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise WorkloadError(f"empty sweep {text!r}")
    return items


def arrival_times(
    rate: RateSpec,
    num_requests: int,
    burstiness: float,
    rng: np.random.Generator,
    span_s: float | None = None,
) -> np.ndarray:
    """Arrival offsets in seconds for ``num_requests`` requests, starting at 0.

    ``span_s``: the requests fill exactly that many seconds (a run of a set duration):
    the gaps, with one more after the last request, are scaled to add up to it. For
    Poisson arrivals that is the process conditioned on its count: the arrivals are
    sorted uniform points of the span, bursts and lulls as before, but no run ends
    early or spills past its span by chance (20 requests at 1 req/s drawn one by one
    spanned anywhere from about 12 to 29 s)."""
    if burstiness <= 0:
        raise WorkloadError(f"burstiness must be > 0, got {burstiness}")
    if span_s is not None and span_s <= 0:
        raise WorkloadError(f"span must be > 0 s, got {span_s}")
    if num_requests <= 0:
        return np.zeros(0)
    if math.isinf(rate.start_rps):
        return np.zeros(num_requests)
    n = num_requests if span_s is None else num_requests + 1
    if rate.end_rps is None:
        rates = np.full(n, rate.start_rps)
    else:
        rates = np.linspace(rate.start_rps, rate.end_rps, n)
    # Gamma(shape=k, scale=1/(k*rate)) has mean 1/rate for any k.
    gaps = rng.gamma(burstiness, 1.0 / (burstiness * rates))
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    if span_s is None:
        return times
    # The first request comes at 0 and the extra gap closes the span: the last time
    # (where the next request would come) is the span's end.
    return times[:num_requests] * (span_s / times[-1])
