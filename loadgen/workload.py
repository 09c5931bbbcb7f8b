"""Synthetic workloads: length distributions parsed from strings, and request specs.

A workload is a list of ``RequestSpec`` (what to send and when) built from a
seed, so the same flags always give the same requests. Lengths are in tokens:
tokens of the target tokenizer when one is given, otherwise approximate (the
built-in ``tiny`` model is byte-level, so one character is one token there).

Length specs (``parse_length``)::

    256                                  fixed
    fixed:256
    uniform:32-256                       integers, both ends included
    normal:mean=300,std=50
    lognormal:mean=300,sigma=1.0         ``mean`` is the arithmetic mean
    mix:0.9*uniform:32-256,0.1*uniform:2000-6000

Every sample is clipped to at least 1 token.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "Fixed",
    "LengthDist",
    "LogNormal",
    "Mixture",
    "Normal",
    "RequestSpec",
    "Uniform",
    "WorkloadError",
    "parse_length",
]


class WorkloadError(ValueError):
    """A workload flag or file that cannot be understood; the message names it."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: its arrival offset and token lengths.

    ``hash_ids`` name the prompt's blocks of ``hash_block_size`` tokens in
    order (Mooncake trace convention): two requests sharing the first k ids
    share a prefix of k blocks. ``prompt`` is real text when replaying a
    ShareGPT file; otherwise text is synthesised from the ids and lengths.
    """

    request_id: str
    arrival_s: float  # offset from the start of the run; ignored by closed-loop runs
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    hash_block_size: int = 16
    prompt: str | None = None
    session_id: int | None = None
    turn: int = 0
    image_sides: tuple[int, ...] = ()  # square images (pixels per side) sent with a chat prompt


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray: ...

    @property
    def mean(self) -> float: ...


def _clip(x: np.ndarray) -> np.ndarray:
    return np.maximum(np.rint(x), 1).astype(np.int64)


@dataclass(frozen=True, slots=True)
class Fixed:
    value: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, max(self.value, 1), dtype=np.int64)

    @property
    def mean(self) -> float:
        return float(max(self.value, 1))


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _clip(rng.integers(self.low, self.high + 1, size=n))

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True, slots=True)
class Normal:
    mean_tokens: float
    std: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _clip(rng.normal(self.mean_tokens, self.std, size=n))

    @property
    def mean(self) -> float:
        return self.mean_tokens


@dataclass(frozen=True, slots=True)
class LogNormal:
    mean_tokens: float  # arithmetic mean, not the median
    sigma: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean_tokens) - self.sigma**2 / 2
        return _clip(rng.lognormal(mu, self.sigma, size=n))

    @property
    def mean(self) -> float:
        return self.mean_tokens


@dataclass(frozen=True, slots=True)
class Mixture:
    weights: tuple[float, ...]  # normalised to sum to 1
    parts: tuple[LengthDist, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        which = rng.choice(len(self.parts), size=n, p=np.asarray(self.weights))
        out = np.empty(n, dtype=np.int64)
        for i, part in enumerate(self.parts):
            mask = which == i
            out[mask] = part.sample(rng, int(mask.sum()))
        return out

    @property
    def mean(self) -> float:
        return sum(w * p.mean for w, p in zip(self.weights, self.parts))


_MIX_SPLIT = re.compile(r",(?=\s*[0-9.]+\s*\*)")


def parse_length(spec: str) -> LengthDist:
    """Parse a length distribution; raise ``WorkloadError`` naming what is wrong."""
    text = spec.strip()
    if not text:
        raise WorkloadError("empty length spec")
    if re.fullmatch(r"\d+", text):
        return _positive_fixed(int(text), spec)
    kind, sep, rest = text.partition(":")
    if not sep:
        raise WorkloadError(
            f"bad length spec {spec!r}: expected a number or KIND:PARAMS "
            "(fixed, uniform, normal, lognormal, mix)"
        )
    match kind.strip().lower():
        case "fixed":
            return _positive_fixed(_int(rest, spec), spec)
        case "uniform":
            low_s, dash, high_s = rest.partition("-")
            if not dash:
                raise WorkloadError(f"bad length spec {spec!r}: uniform needs LOW-HIGH")
            low, high = _int(low_s, spec), _int(high_s, spec)
            if not 1 <= low <= high:
                raise WorkloadError(f"bad length spec {spec!r}: need 1 <= LOW <= HIGH")
            return Uniform(low, high)
        case "normal":
            params = _params(rest, spec, ("mean", "std"))
            if params["mean"] <= 0 or params["std"] < 0:
                raise WorkloadError(f"bad length spec {spec!r}: need mean > 0 and std >= 0")
            return Normal(params["mean"], params["std"])
        case "lognormal":
            params = _params(rest, spec, ("mean", "sigma"))
            if params["mean"] <= 0 or params["sigma"] < 0:
                raise WorkloadError(f"bad length spec {spec!r}: need mean > 0 and sigma >= 0")
            return LogNormal(params["mean"], params["sigma"])
        case "mix":
            return _parse_mix(rest, spec)
        case other:
            raise WorkloadError(
                f"bad length spec {spec!r}: unknown kind {other!r} "
                "(fixed, uniform, normal, lognormal, mix)"
            )


def _parse_mix(rest: str, spec: str) -> Mixture:
    weights: list[float] = []
    parts: list[LengthDist] = []
    for item in _MIX_SPLIT.split(rest):
        weight_s, star, part_s = item.partition("*")
        if not star:
            raise WorkloadError(f"bad length spec {spec!r}: mix parts are WEIGHT*SPEC")
        weight = _float(weight_s, spec)
        if weight <= 0:
            raise WorkloadError(f"bad length spec {spec!r}: mix weights must be > 0")
        weights.append(weight)
        parts.append(parse_length(part_s))
    total = sum(weights)
    return Mixture(tuple(w / total for w in weights), tuple(parts))


def _params(rest: str, spec: str, names: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise WorkloadError(f"bad length spec {spec!r}: expected {'=…,'.join(names)}=…")
        out[key] = _float(value, spec)
    missing = [n for n in names if n not in out]
    if missing:
        raise WorkloadError(f"bad length spec {spec!r}: missing {', '.join(missing)}")
    return out


def _positive_fixed(value: int, spec: str) -> Fixed:
    if value < 1:
        raise WorkloadError(f"bad length spec {spec!r}: length must be >= 1")
    return Fixed(value)


def _int(text: str, spec: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise WorkloadError(
            f"bad length spec {spec!r}: {text.strip()!r} is not an integer"
        ) from None


def _float(text: str, spec: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise WorkloadError(f"bad length spec {spec!r}: {text.strip()!r} is not a number") from None
