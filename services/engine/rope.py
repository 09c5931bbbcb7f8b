"""Rotary position embeddings (plain, linear and llama3-scaled), applied at absolute positions.

The frequencies are computed in float32 from ``ModelArgs`` rather than stored in
the checkpoint, and cos/sin are cast to the activation dtype only at the end,
as the reference implementation does, so float32 logits match it to ~1e-6.
"""

from __future__ import annotations

import math

import torch

from services.engine.config import ModelArgs

__all__ = ["RotaryEmbedding", "apply_rotary", "inverse_frequencies"]


def inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with any rope scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (
        args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
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
    """Computes cos/sin for a step's positions once; every layer reuses them."""

    def __init__(self, args: ModelArgs) -> None:
        self._inv_freq_cpu = inverse_frequencies(args)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] in ``dtype`` (broadcast over heads)."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            self._inv_freq[positions.device] = inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split convention of the HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
