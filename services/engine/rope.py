"""Rotary position embeddings (plain, linear and llama3-scaled), applied at absolute positions.

Frequencies are computed in float32 from ``ModelArgs`` (they are not in the
checkpoint); cos/sin tables are cast to the activation dtype once, as the
reference implementation casts them, and indexed by position each step.
"""

from __future__ import annotations

import math

import torch

from services.engine.config import ModelArgs

__all__ = ["RotaryEmbedding", "apply_rotary", "inverse_frequencies"]

_MIN_TABLE_POSITIONS = 4096


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with any rope scaling applied."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (args.rope_theta**exponents)
    scaling = args.rope_scaling or {}
    match scaling.get("rope_type", "default"):
        case "default":
            return inv_freq
        case "linear":
            return inv_freq / float(scaling["factor"])
        case "llama3":
            return _llama3_scale(inv_freq, scaling)
        case other:
            raise ValueError(f"rope type {other!r}")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables per (device, dtype), grown on demand; every layer reuses a step's rows."""

    def __init__(self, args: ModelArgs) -> None:
        self._inv_freq = inverse_frequencies(args)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(
        self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ([T, 1, head_dim], ``dtype``) for ``apply_rotary``.

        ``max_position`` bounds ``positions`` (known from the batch without a device sync).
        """
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] <= max_position:
            size = max(_MIN_TABLE_POSITIONS, 1 << max_position.bit_length())
            table = self._build(size, positions.device, dtype)
            self._tables[key] = table
        cos, sin = table
        return cos[positions][:, None, :], sin[positions][:, None, :]

    def _build(
        self, num_positions: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        # Signed sin folds rotate_half's negation in: rot(x) * sin == roll(x) * signed_sin.
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split convention of the HF checkpoints."""
    half = x.shape[-1] // 2
    rolled = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rolled, signed_sin)
