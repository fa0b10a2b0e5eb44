"""A readable Llama-family decoder (Llama 3.x / SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3 text).

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
    """RMS normalization; Gemma's (``gemma``) scales by ``1 + weight`` in fp32 before the cast back."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """RoPE's inverse frequencies [D/2] for base ``theta``, scaled as ``scaling`` says (None: not)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_scale(inv_freq, scaling)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention), with Llama 3 or linear frequency
    scaling; local (sliding-window) layers may have their own base (Gemma 3)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(args.head_dim, args.rope_theta, args.rope_scaling),
                             persistent=False)  # [D/2]
        local = args.local_rope_theta is not None
        self.register_buffer("local_inv_freq", _inv_freq(args.head_dim, args.local_rope_theta, None) if local
                             else None, persistent=False)  # [D/2]

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """positions [N] -> {table: (cos, sin) [N, 1, D]} of their angles, for the ``global``
        table and, where local layers have their own base, the ``local`` one; computed once per
        forward pass for every layer's queries and keys."""
        tables = {"global": self.inv_freq}
        if self.local_inv_freq is not None:
            tables["local"] = self.local_inv_freq
        out = {}
        for table, inv_freq in tables.items():
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
            out[table] = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
        return out


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
        self.q_norm = RMSNorm(d, args.rms_norm_eps, args.gemma_norms) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps, args.gemma_norms) if args.qk_norm else None
        # every backend scales scores by D^-0.5: a model with its own query scale folds the ratio in here
        scalar = args.query_pre_attn_scalar
        self.query_scale = None if scalar is None or scalar == d else (d / scalar) ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """x [N, hidden] at the positions whose rotary ``cos`` and ``sin`` [N, 1, D] are given."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.n_heads, self.head_dim)  # [N, Hq, D]
        k = self.k_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        v = self.v_proj(x).view(n, self.n_kv, self.head_dim)  # [N, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        out = backend.attend(self.layer, q, k, v)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """A gated MLP: SwiGLU, or GeGLU with tanh-approximated GELU (Gemma)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.gelu = args.mlp_activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)  # [N, I]
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; Gemma's ``gemma_norms`` also normalize each one's output
    (its ``post_attention_layernorm`` is that, and ``pre_feedforward_layernorm`` the MLP's input)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        local_base = args.window(layer) is not None and args.local_rope_theta is not None
        self.rope_table = "local" if local_base else "global"  # which of Rotary.angles it reads
        hidden, eps, gemma = args.hidden_size, args.rms_norm_eps, args.gemma_norms
        self.input_layernorm = RMSNorm(hidden, eps, gemma)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(hidden, eps, gemma)
        self.mlp = MLP(args)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, gemma)
        self.gemma = gemma

    def forward(self, x, cos, sin, backend):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, backend)  # [N, hidden]
        if not self.gemma:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Decoder(nn.Module):
    """Token ids in, logits out; parameter names match Hugging Face checkpoints."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.gemma_norms)
        self.embed_scale = args.hidden_size**0.5 if args.gemma_norms else None  # Gemma scales its embeddings
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
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the weights' dtype, as trained
        angles = self.rotary.angles(positions, x.dtype)  # {table: cos, sin [N, 1, D]}
        for layer in self.layers:
            x = layer(x, *angles[layer.rope_table], backend)
        if logit_rows is not None:
            x = x[logit_rows]  # [R, hidden]
        return self.lm_head(self.norm(x)).float()  # [R, V]
