"""A readable Llama-family decoder (Llama 3.x / SmolLM2, Mistral, Qwen2, Qwen3).

The model never owns a KV cache: every attention layer hands its new queries, keys and values
to an :class:`AttentionBackend`, which stores them (paged, offloaded, compressed...) and returns
the attention output. This keeps the model one small file and lets every cache policy reuse it.
Tokens are a flat ragged batch ``[N]`` with their absolute positions, as in nano-vllm.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from icekv.model.args import ModelArgs
from icekv.model.linear import Linear


class AttentionBackend(Protocol):
    """Stores a layer's new K/V and attends the step's queries over the request's cache."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [N, Hq, D] and k, v [N, Hkv, D] (post-RoPE) -> attention output [N, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention), with Llama 3 frequency scaling."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.head_dim
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if args.rope_scaling is not None:
            inv_freq = _llama3_scale(inv_freq, args.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos and sin [N, 1, D] of their angles, computed once per forward pass
        for every layer's queries and keys."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by the angles whose cos and sin [N, 1, D] are given (rotate-half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor = cfg["factor"]
    low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=args.qkv_bias)
        self.k_proj = Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.v_proj = Linear(h, self.n_kv * d, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """x [N, hidden] at the positions whose rotary ``cos`` and ``sin`` [N, 1, D] are given."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)  # [N, Hq, D]
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = backend.attend(self.layer, q, k, v)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token ids in, logits out; parameter names match Hugging Face checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = Rotary(args)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, positions [N] -> logits [R, V] for ``logit_rows`` (all N rows when None)."""
        x = self.embed_tokens(tokens)  # [N, hidden]
        cos, sin = self.rotary.angles(positions, x.dtype)  # [N, 1, D] each
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        if logit_rows is not None:
            x = x[logit_rows]  # [R, hidden]
        return self.lm_head(self.norm(x)).float()  # [R, V]
