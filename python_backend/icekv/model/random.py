"""Models with the shapes of real checkpoints and weights drawn at random.

Latency does not depend on weight values, so GPU benchmarks run a real model's shapes without its
weights (none can be fetched there). Each linear layer is drawn with std ``1/sqrt(fan_in)`` and
the embeddings with std 1, so activations and logits keep unit scale through any depth: greedy
tokens are then decided by clear margins, not by rounding (the CPU/CUDA parity check needs that).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from icekv.errors import ConfigError
from icekv.model.args import ModelArgs
from icekv.model.llama import Decoder, Rotary
from icekv.model.weights import return_freed_heap, store_linears, stored_apart

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
                 seed: int = 0, weights: str | None = None) -> Decoder:
    """The named shape with weights drawn on ``device`` from ``seed`` (the same seed and device
    give the same weights, whichever ``weights``). ``weights``: the form its linear layers are
    stored in (:func:`store_linears`; by default ``dtype``), each block stored as soon as it is
    drawn, so that an 8B shape in int8 never holds more than one block in float."""
    args = shape_args(name)
    with torch.device("meta"):
        model = Decoder(args)
    generator = torch.Generator(device).manual_seed(seed)
    stored = weights is not None and stored_apart(weights, str(dtype).removeprefix("torch."))
    for parent, attribute, path in _blocks(model):  # a tied output layer is drawn apart, as any other
        block = getattr(parent, attribute)
        state = {key: _drawn(f"{path}.{key}", param.shape, device, generator).to(dtype)
                 for key, param in block.state_dict().items()}
        block.load_state_dict(state, assign=True)
        if stored:
            setattr(parent, attribute, store_linears(block, weights, path))
    if stored:
        return_freed_heap()
    with torch.device(device):
        model.rotary = Rotary(args)  # its buffer was created on the meta device
    return model.eval()


def _blocks(model: Decoder):
    """(parent, attribute, name in the model) of each of the model's parts that hold weights, in
    the state dict's order, the decoder layers one at a time."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            yield from ((child, str(i), f"{name}.{i}") for i in range(len(child)))
        elif name != "rotary":  # no weights: rebuilt on the device
            yield model, name, name


def _drawn(key: str, shape: torch.Size, device, generator: torch.Generator) -> torch.Tensor:
    """The float32 value of the weight ``key``: norms 1, embeddings N(0, 1), linear layers
    N(0, 1/fan_in)."""
    value = torch.empty(shape, dtype=torch.float32, device=device)
    if key.endswith("norm.weight"):
        return value.fill_(1.0)
    std = 1.0 if key == "embed_tokens.weight" else 1 / math.sqrt(shape[-1])
    return value.normal_(0.0, std, generator=generator)
