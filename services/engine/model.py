"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV pool.

Module names follow the Hugging Face checkpoints, except that q/k/v and
gate/up projections are fused (``qkv_proj``, ``gate_up_proj``): on a CPU at small
batch every kernel launch counts, so a layer runs about twenty ops. ``fuse_checkpoint``
maps a checkpoint's state dict onto these names. One forward runs every
scheduled token of every sequence as one flat ``[T, hidden]`` batch; only
attention looks at sequence boundaries (see ``attention.py``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import paged_attention, write_kv
from services.engine.attention_metadata import AttentionMetadata, PoolView
from services.engine.batch import ForwardBatch
from services.engine.config import ModelArgs
from services.engine.cpu_kernels import CpuKernels
from services.engine.linear import GatedLinear, linear, linear_add, silu_mul
from services.engine.rope import RotaryEmbedding, apply_rotary

__all__ = [
    "FUSED_PROJECTIONS",
    "CausalLM",
    "RMSNorm",
    "fuse_checkpoint",
    "rms_norm",
    "unfuse_checkpoint",
]

# fused module -> the checkpoint modules concatenated (along the output dim) into it
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PART_RE = re.compile(r"^(.*\.)(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$")


def fuse_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate per-projection checkpoint tensors into the fused ones; raise KeyError naming a missing part."""
    fused = {k: v for k, v in state.items() if not _PART_RE.match(k)}
    groups: set[tuple[str, str, str]] = set()
    for key in state:
        m = _PART_RE.match(key)
        if m:
            prefix, part, kind = m.groups()
            target = next(t for t, parts in FUSED_PROJECTIONS.items() if part in parts)
            groups.add((prefix, target, kind))
    for prefix, target, kind in sorted(groups):
        names = [f"{prefix}{part}.{kind}" for part in FUSED_PROJECTIONS[target]]
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(", ".join(missing))
        fused[f"{prefix}{target}.{kind}"] = torch.cat([state[n] for n in names], dim=0)
    return fused


def unfuse_checkpoint(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The inverse of ``fuse_checkpoint``: Hugging Face names (to export, or to build an HF twin)."""
    q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    sizes = {
        "self_attn.qkv_proj": [q_dim, kv_dim, kv_dim],
        "mlp.gate_up_proj": [args.intermediate_size, args.intermediate_size],
    }
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        target = next((t for t in FUSED_PROJECTIONS if f".{t}." in key), None)
        if target is None:
            out[key] = tensor
            continue
        prefix, kind = key.split(f"{target}.")
        for part, piece in zip(FUSED_PROJECTIONS[target], tensor.split(sizes[target], dim=0)):
            out[f"{prefix}{part}.{kind}"] = piece
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Spelled out rather than F.rms_norm: on a CPU that one is ~2.6x slower at prefill sizes
    # ([1024, 768]) and no faster at decode. Half types normalise in float32 and cast back
    # before the weight, as HF does.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
    if x.dtype == torch.float32:
        return normed.mul_(weight)
    return weight * normed.to(x.dtype)


def _norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: CpuKernels | None
) -> torch.Tensor:
    """``rms_norm``, in one C++ pass when the engine chose the CPU kernels."""
    if kernels is not None and x.is_contiguous():
        return kernels.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# The forwards below call linear / rms_norm on the parameters rather than the
# submodules: at decode on a CPU, module-call overhead is a visible share of a step.
# ``linear`` uses a layer's packed CPU weight when the engine made one (linear.py).


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        self.eps = args.rms_norm_eps
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qk_dim = q_dim + kv_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q_dim + 2 * kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: PoolView,
        meta: AttentionMetadata,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """``residual`` plus this layer's attention output."""
        num_tokens, h = x.shape[0], self.num_heads
        qkv = linear(x, self.qkv_proj)
        # q and k heads side by side, so RoPE runs once over both.
        qk = qkv[:, : self.qk_dim].view(num_tokens, h + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.qk_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q_normed = rms_norm(qk[:, :h], self.q_norm.weight, self.eps)
            qk = torch.cat((q_normed, rms_norm(qk[:, h:], self.k_norm.weight, self.eps)), dim=1)
        kernels = meta.cpu_kernels
        if kernels is None:
            qk = apply_rotary(qk, *cos_sin)
            write_kv(pool, self.layer_idx, meta, qk[:, h:], v)
        else:  # the same, fused: rotated in place, K/V stored at the slots
            kernels.rotary_write_(qk, v, *cos_sin, pool.kv, self.layer_idx, meta.slots)
        o = paged_attention(qk[:, :h], qk[:, h:], v, pool, self.layer_idx, meta, self.scale)
        return linear_add(o, self.o_proj, residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = GatedLinear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual`` plus this MLP's output."""
        return linear_add(silu_mul(x, self.gate_up_proj), self.down_proj, residual)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        pool: PoolView,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = _norm(x, self.input_layernorm.weight, self.eps, meta.cpu_kernels)
        x = self.self_attn.forward(h, cos_sin, pool, meta, residual=x)
        h = _norm(x, self.post_attention_layernorm.weight, self.eps, meta.cpu_kernels)
        return self.mlp.forward(h, residual=x)


class DecoderStack(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(args)
        # The C++ kernels (cpu_kernels.py: attention, RMSNorm, rotary + KV write),
        # chosen by the engine at start; None: the torch ops.
        self.cpu_kernels: CpuKernels | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face checkpoint names (loadable into e.g. ``LlamaForCausalLM``)."""
        return unfuse_checkpoint(self.state_dict(), self.args)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings (a multimodal caller then places images)."""
        weight = self.model.embed_tokens.weight
        return F.embedding(input_ids.to(weight.device), weight)

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, kv: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens; writes their K/V into ``kv``.

        ``kv`` is the pool ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
        in the model's dtype and device. ``inputs_embeds`` ([T, hidden]) replaces the
        embeddings of ``batch.input_ids`` (image embeddings at image positions).
        """
        device = self.model.embed_tokens.weight.device
        pool = PoolView.of(kv)
        meta = AttentionMetadata.build(
            batch,
            pool=pool,
            num_queries_per_kv=self.args.num_queries_per_kv,
            sliding_window=self.args.sliding_window,
            device=device,
            dtype=self.model.embed_tokens.weight.dtype,
            cpu_kernels=self.cpu_kernels,
        )
        if inputs_embeds is None:
            x = F.embedding(batch.input_ids.to(device), self.model.embed_tokens.weight)
        else:
            x = inputs_embeds
        positions = batch.positions.to(device)
        cos_sin = self.rotary.cos_sin(positions, max(batch.context_lens) - 1, x.dtype)
        for layer in self.model.layers:
            x = layer.forward(x, cos_sin, pool, meta)
        return _norm(x, self.model.norm.weight, self.args.rms_norm_eps, self.cpu_kernels)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return linear(hidden, self.lm_head).float()
