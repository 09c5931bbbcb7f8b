"""A worker's measured speeds: the coefficients a ``CostModel`` is seeded from, and
their JSON file.

Profile JSON format (``loadgen/profiles/*.json``; all times in seconds)::

    {
      "model": "Qwen/Qwen2.5-7B-Instruct",
      "hardware": "1x H100 80GB",
      "prefill": {"a": 0.012, "b": 6.0e-5, "c": 1.0e-9},      # a + b n + c n²
      "decode": {"a": 0.008, "b": 5.0e-5, "c": 2.0e-8},       # a + b B + c ΣL
      "transfer": {"bandwidth_bytes_per_s": 2.5e10, "latency_s": 0.0005},
      "kv_bytes_per_token": 57344,
      "num_kv_blocks": 20000,
      "block_size": 16,
      "max_num_seqs": 256,
      "sources": ["how each number was obtained", "..."],
      "encode": {"a": 0.0, "b": 0.0}                          # optional: a + b·image tokens
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_PROFILE",
    "EncodeCoeffs",
    "Profile",
    "QuadCoeffs",
    "TransferCoeffs",
    "load_profile",
    "save_profile",
]


@dataclass(frozen=True, slots=True)
class QuadCoeffs:
    """Three coefficients ``a, b, c``; the meaning of the terms depends on the curve."""

    a: float
    b: float
    c: float

    def at(self, n: float) -> float:
        """``a + n(b + cn)``: a prefill curve's seconds for ``n`` tokens."""
        return self.a + n * (self.b + self.c * n)


@dataclass(frozen=True, slots=True)
class TransferCoeffs:
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class EncodeCoeffs:
    a: float = 0.0
    b: float = 0.0  # seconds per image token

    def encode_s(self, num_image_tokens: float) -> float:
        """Seconds to encode images of ``num_image_tokens`` tokens (0 for none)."""
        return self.a + self.b * num_image_tokens if num_image_tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Profile:
    model: str
    hardware: str
    prefill: QuadCoeffs
    decode: QuadCoeffs
    transfer: TransferCoeffs
    kv_bytes_per_token: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    sources: tuple[str, ...] = ()
    encode: EncodeCoeffs = EncodeCoeffs()
    # KV blocks the vision weights take on a worker that holds them; a worker that never
    # encodes has ``num_kv_blocks + vision_kv_blocks`` (0: not accounted separately)
    vision_kv_blocks: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        try:
            return cls(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                prefill=QuadCoeffs(**{k: float(data["prefill"][k]) for k in "abc"}),
                decode=QuadCoeffs(**{k: float(data["decode"][k]) for k in "abc"}),
                transfer=TransferCoeffs(
                    bandwidth_bytes_per_s=float(data["transfer"]["bandwidth_bytes_per_s"]),
                    latency_s=float(data["transfer"]["latency_s"]),
                ),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                num_kv_blocks=int(data["num_kv_blocks"]),
                block_size=int(data["block_size"]),
                max_num_seqs=int(data["max_num_seqs"]),
                sources=tuple(str(s) for s in data.get("sources", ())),
                encode=EncodeCoeffs(**{k: float(v) for k, v in data.get("encode", {}).items()}),
                vision_kv_blocks=int(data.get("vision_kv_blocks", 0)),
            )
        except KeyError as exc:
            raise ValueError(f"profile is missing field {exc.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "prefill": {"a": self.prefill.a, "b": self.prefill.b, "c": self.prefill.c},
            "decode": {"a": self.decode.a, "b": self.decode.b, "c": self.decode.c},
            "transfer": {
                "bandwidth_bytes_per_s": self.transfer.bandwidth_bytes_per_s,
                "latency_s": self.transfer.latency_s,
            },
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "sources": list(self.sources),
            "encode": {"a": self.encode.a, "b": self.encode.b},
            "vision_kv_blocks": self.vision_kv_blocks,
        }


def load_profile(path: str | Path) -> Profile:
    return Profile.from_dict(json.loads(Path(path).read_text()))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


# Used when no profile is configured. Prefill and decode follow DistServe's fitted
# OPT-13B on one A100 (time_estimator.py), converted from ms to s; KV size is OPT-13B's.
DEFAULT_PROFILE = Profile(
    model="facebook/opt-13b",
    hardware="1x A100 80GB",
    prefill=QuadCoeffs(a=0.0181, b=1.02e-4, c=7.1e-9),
    decode=QuadCoeffs(a=0.0124, b=1.0e-4, c=1.5e-7),
    transfer=TransferCoeffs(bandwidth_bytes_per_s=3.125e9, latency_s=0.001),
    kv_bytes_per_token=819200,
    num_kv_blocks=2500,
    block_size=16,
    max_num_seqs=256,
    sources=(
        "prefill/decode: DistServe simdistserve/estimators/time_estimator.py, OPT-13B TP1 A100",
        "transfer: 25 Gbit/s between nodes (DistServe testbed)",
        "kv_bytes_per_token: 40 layers x 2 x 5120 x fp16",
    ),
)
