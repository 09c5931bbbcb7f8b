"""The cost profile the simulator runs on (same JSON as the router's cost model seed).

::

    {"model", "hardware",
     "prefill": {"a", "b", "c"},        prefill time  a + b·n + c·n²  s, n new tokens
     "decode":  {"a", "b", "c"},        decode step   a + b·B + c·ΣL  s, batch B, context ΣL
     "transfer": {"bandwidth_bytes_per_s", "latency_s"},
     "kv_bytes_per_token", "num_kv_blocks", "block_size", "max_num_seqs",
     "sources": [...]}                  where the numbers come from

``load_profile`` validates and names the missing field. A batched prefill of
several prompts costs ``a + Σ(b·n_i + c·n_i²)`` (attention is quadratic per
sequence, the rest linear in the total).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PROFILE", "Coeffs", "Profile", "load_profile", "profile_to_json"]

DEFAULT_PROFILE = "tiny-cpu.json"


@dataclass(frozen=True, slots=True)
class Coeffs:
    a: float
    b: float
    c: float


@dataclass(frozen=True, slots=True)
class Profile:
    model: str
    hardware: str
    prefill: Coeffs
    decode: Coeffs
    bandwidth_bytes_per_s: float
    latency_s: float
    kv_bytes_per_token: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    sources: tuple[str, ...] = ()

    @property
    def capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def prefill_s(self, num_tokens: int) -> float:
        p = self.prefill
        return p.a + p.b * num_tokens + p.c * num_tokens * num_tokens

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        d = self.decode
        return d.a + d.b * batch_size + d.c * context_tokens

    def transfer_s(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s + self.latency_s


def load_profile(path: str | Path | None = None) -> Profile:
    """Load a profile file; ``None`` or a bare shipped name loads from loadgen/profiles."""
    if path is None or (isinstance(path, str) and "/" not in path and not Path(path).exists()):
        name = DEFAULT_PROFILE if path is None else path
        name = name if name.endswith(".json") else name + ".json"
        text = resources.files("loadgen.profiles").joinpath(name).read_text()
        source = f"loadgen/profiles/{name}"
    else:
        text = Path(path).read_text()
        source = str(path)
    return profile_from_json(json.loads(text), source)


def profile_from_json(data: dict[str, Any], source: str = "profile") -> Profile:
    try:
        return Profile(
            model=str(data["model"]),
            hardware=str(data["hardware"]),
            prefill=Coeffs(**{k: float(data["prefill"][k]) for k in "abc"}),
            decode=Coeffs(**{k: float(data["decode"][k]) for k in "abc"}),
            bandwidth_bytes_per_s=float(data["transfer"]["bandwidth_bytes_per_s"]),
            latency_s=float(data["transfer"]["latency_s"]),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            num_kv_blocks=int(data["num_kv_blocks"]),
            block_size=int(data["block_size"]),
            max_num_seqs=int(data["max_num_seqs"]),
            sources=tuple(str(s) for s in data.get("sources", ())),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: bad value ({e})") from None


def profile_to_json(profile: Profile) -> dict[str, Any]:
    return {
        "model": profile.model,
        "hardware": profile.hardware,
        "prefill": asdict(profile.prefill),
        "decode": asdict(profile.decode),
        "transfer": {
            "bandwidth_bytes_per_s": profile.bandwidth_bytes_per_s,
            "latency_s": profile.latency_s,
        },
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "num_kv_blocks": profile.num_kv_blocks,
        "block_size": profile.block_size,
        "max_num_seqs": profile.max_num_seqs,
        "sources": list(profile.sources),
    }
