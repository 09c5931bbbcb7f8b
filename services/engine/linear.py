"""Linear layers with their CPU weights packed once into oneDNN's blocked layout.

At decode on a CPU a step is mostly products of a few rows against every weight.
PyTorch's default float32 CPU product reads each weight in its plain layout on
every call; oneDNN with the weight reordered once into its blocked layout (what
inductor's CPU freezing and vLLM's CPU backend do) runs the same product faster,
about 1.1-2x per layer on the AVX2 machines here, most for the widest (the LM
head). The packed copy sits beside the weight (``packed_weight``), so the state
dict, tied embeddings and the Hugging Face export are unchanged; it costs one more
copy of the linear weights in memory (``engine.packed_linears: false`` turns it off).
Results differ from ``F.linear`` only in float rounding (a different summation order).

Packed calls also fuse the elementwise work around a product into it (oneDNN post-ops):
``linear_add`` adds the residual, and ``silu_mul`` runs a ``GatedLinear`` ([gate; up]
fused along the output) as two packed halves, silu on the gate's output and the product
with the up half fused in. At prefill the separate passes over [tokens, 2 x intermediate]
cost a fifth of the MLP (2048 tokens x 768 -> 2x2048 -> 768, one AVX-512 thread: 120 ms
-> 96 ms a layer); at decode it is even.

Only weights of at least ``MIN_PACKED_ELEMENTS`` are packed: a packed call costs
about 20 us more than ``F.linear`` before it does any arithmetic, which is most of
a small layer's time (the built-in tiny model's 64-wide layers: 25 us packed
against 4 us plain, one thread, measured here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MIN_PACKED_ELEMENTS",
    "GatedLinear",
    "can_pack",
    "linear",
    "linear_add",
    "pack_linears",
    "silu_mul",
]

_PACKED = "packed_weight"
_PACKED_HALVES = "packed_halves"
# 512 x 512: from here on the blocked layout repays its fixed cost at a few rows.
MIN_PACKED_ELEMENTS = 2**18


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``F.linear(x, layer.weight, layer.bias)``, through the packed weight if there is one."""
    packed = layer.__dict__.get(_PACKED)
    if packed is None:
        return F.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


def linear_add(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """``residual + linear(x, layer)``, the sum fused into the packed product."""
    packed = layer.__dict__.get(_PACKED)
    if packed is None:
        return residual + F.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, layer.bias, "add")


class GatedLinear(nn.Linear):
    """A [gate; up] projection fused along the output dim (no bias), for ``silu_mul``."""


def silu_mul(x: torch.Tensor, layer: GatedLinear) -> torch.Tensor:
    """``silu(gate) * up`` of ``layer``'s two output halves."""
    halves = layer.__dict__.get(_PACKED_HALVES)
    if halves is None:
        gate, up = linear(x, layer).chunk(2, dim=-1)
        return F.silu(gate) * up
    packed_gate, packed_up = halves
    gate = torch.ops.mkldnn._linear_pointwise(x, packed_gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, packed_up, None, "mul")


def can_pack(model: nn.Module) -> bool:
    """Float32 weights on a CPU, and a torch built with oneDNN's packed linear."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn._linear_pointwise, "binary")
    )


@torch.no_grad()
def pack_linears(
    model: nn.Module, batch_size_hint: int, min_elements: int = MIN_PACKED_ELEMENTS
) -> int:
    """Pack every ``nn.Linear`` of ``model`` whose weight has at least ``min_elements``
    (call again after changing its weights); returns how many were packed."""

    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)

    num_packed = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.numel() < min_elements:
            continue
        if isinstance(module, GatedLinear) and module.bias is None:
            # Its halves instead of the whole: silu_mul is its only caller.
            gate, up = module.weight.chunk(2, dim=0)
            module.__dict__[_PACKED_HALVES] = (pack(gate.contiguous()), pack(up.contiguous()))
        else:
            module.__dict__[_PACKED] = pack(module.weight)
        num_packed += 1
    return num_packed
