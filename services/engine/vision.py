"""A CLIP-style ViT vision tower: pixels to per-patch hidden states.

Module names follow Hugging Face's ``CLIPVisionModel`` (``embeddings``, ``pre_layrnorm``
(sic), ``encoder.layers.N``, ``post_layernorm``), so a checkpoint's tensors load by name.
A LLaVA model reads the hidden states of one or more layers (its
``vision_feature_layer``), never the pooled output, so the tower runs only as many
layers as the deepest one it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.messages import UnsupportedModelError

__all__ = ["SUPPORTED_VISION_TOWERS", "VisionArgs", "VisionTower", "activation"]

SUPPORTED_VISION_TOWERS = ("clip_vision_model",)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Any:
    """The activation function Hugging Face names ``name``; UnsupportedModelError otherwise."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return fn


@dataclass(frozen=True, slots=True)
class VisionArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # square input, pixels per side
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise UnsupportedModelError(
                f"vision hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_heads})"
            )
        activation(self.hidden_act)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> VisionArgs:
        """Read a parsed ``vision_config``; UnsupportedModelError names a tower we do not run."""
        model_type = cfg.get("model_type", "clip_vision_model")
        if model_type not in SUPPORTED_VISION_TOWERS:
            raise UnsupportedModelError(
                f"vision tower {model_type!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_VISION_TOWERS)}"
            )
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_channels=int(cfg.get("num_channels", 3)),
            image_size=_side(cfg["image_size"], "image_size"),
            patch_size=_side(cfg["patch_size"], "patch_size"),
            hidden_act=str(cfg.get("hidden_act", "quick_gelu")),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        )


def _side(value: Any, name: str) -> int:
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"vision {name} must be square, got {value}")
        value = value[0]
    return int(value)


class VisionEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.class_embedding = nn.Parameter(torch.zeros(args.hidden_size))
        self.patch_embedding = nn.Conv2d(
            args.num_channels,
            args.hidden_size,
            kernel_size=args.patch_size,
            stride=args.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(args.num_patches + 1, args.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, S, S] -> [N, 1 + patches, hidden]: the class token, then patches row by row."""
        side = self.args.image_size
        if tuple(pixel_values.shape[-2:]) != (side, side):
            raise ValueError(
                f"the vision tower takes {side}x{side} images, got {tuple(pixel_values.shape)}"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.num_heads = args.num_heads
        self.head_dim = d // args.num_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        # Every patch sees every patch: no mask, no causality.
        o = F.scaled_dot_product_attention(
            heads(self.q_proj), heads(self.k_proj), heads(self.v_proj), scale=self.head_dim**-0.5
        )
        return self.out_proj(o.transpose(1, 2).reshape(n, t, d))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.act = activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(args) for _ in range(args.num_layers))


class VisionTower(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = VisionEmbeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.encoder = VisionEncoder(args)
        # Kept so checkpoints load strictly; LLaVA reads hidden states, not the pooled output.
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def hidden_state_index(self, layer: int) -> int:
        """Hugging Face's ``hidden_states[layer]`` as an index in 0..num_layers (0: the embeddings)."""
        num_states = self.args.num_layers + 1
        index = layer + num_states if layer < 0 else layer
        if not 0 <= index < num_states:
            raise UnsupportedModelError(
                f"vision_feature_layer {layer} is outside the tower's {num_states} hidden states"
            )
        return index

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states ``[N, 1 + patches, hidden]`` after each of ``layers`` (HF indexing)."""
        wanted = [self.hidden_state_index(layer) for layer in layers]
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers[: max(wanted)]:
            states.append(layer(states[-1]))
        return [states[i] for i in wanted]
