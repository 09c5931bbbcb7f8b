"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV pool.

Module and parameter names follow the Hugging Face checkpoints
(``model.layers.{i}.self_attn.q_proj.weight`` ...), so loading is a plain
``load_state_dict``. One forward runs every scheduled token of every sequence
as one flat ``[T, hidden]`` batch; only attention looks at sequence boundaries
(see ``attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionMetadata, paged_attention, write_kv
from services.engine.batch import ForwardBatch
from services.engine.config import ModelArgs
from services.engine.rope import RotaryEmbedding, apply_rotary

__all__ = ["CausalLM", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the checkpoints were trained.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, kv_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_dim, args.hidden_size, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        layer_kv = kv[:, self.layer_idx]
        write_kv(layer_kv, meta, k, v)
        o = paged_attention(q, layer_kv, meta, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens; writes their K/V into ``kv``.

        ``kv`` is the pool ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
        in the model's dtype and device.
        """
        device = self.model.embed_tokens.weight.device
        meta = AttentionMetadata.build(
            batch,
            block_size=kv.shape[4],
            num_queries_per_kv=self.args.num_queries_per_kv,
            sliding_window=self.args.sliding_window,
            device=device,
        )
        x = self.model.embed_tokens(batch.input_ids.to(device))
        cos_sin = self.rotary.cos_sin(batch.positions.to(device), x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, kv, meta)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()
