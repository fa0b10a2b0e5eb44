"""Models with the shapes of real checkpoints and weights drawn at random.

Latency does not depend on weight values, so GPU benchmarks run a real model's shapes without its
weights (none can be fetched there). Each linear layer is drawn with std ``1/sqrt(fan_in)`` and
the embeddings with std 1, so activations and logits keep unit scale through any depth: greedy
tokens are then decided by clear margins, not by rounding (the CPU/CUDA parity check needs that).
"""

from __future__ import annotations

import math

import torch

from icekv.errors import ConfigError
from icekv.model.args import ModelArgs
from icekv.model.llama import Decoder, Rotary

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, ModelArgs] = {
    # meta-llama/Llama-3.1-8B-Instruct's config.json
    "llama-3.1-8b": ModelArgs(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False,
        qk_norm=False, eos_token_ids=(128001, 128008, 128009)),
    # a small Llama (GQA groups of 2, Llama 3 RoPE) for tests and the CPU/CUDA parity check
    "llama-tiny": ModelArgs(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=512,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False,
        qk_norm=False, eos_token_ids=()),
}


def shape_args(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise ConfigError(f"random_weights must name one of {', '.join(SHAPES)}, got {name!r}")
    return SHAPES[name]


def random_model(name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0) -> Decoder:
    """The named shape with weights drawn on ``device`` from ``seed`` (the same seed and device
    give the same weights)."""
    args = shape_args(name)
    with torch.device("meta"):
        model = Decoder(args)
    generator = torch.Generator(device).manual_seed(seed)
    state = {}
    for key, param in model.state_dict().items():
        value = torch.empty(param.shape, dtype=torch.float32, device=device)
        if key.endswith("norm.weight"):
            value.fill_(1.0)
        else:
            std = 1.0 if key == "embed_tokens.weight" else 1 / math.sqrt(param.shape[-1])
            value.normal_(0.0, std, generator=generator)
        state[key] = value.to(dtype)
    model.load_state_dict(state, assign=True)
    with torch.device(device):
        model.rotary = Rotary(args)  # its buffer was created on the meta device
    return model.eval()
