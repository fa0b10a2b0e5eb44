"""Hugging Face transformers' own model, as a peer to time icekv against: the same weights (a
model folder, or a random-weight model's tensors shared with icekv's), device and dtype."""

from __future__ import annotations

import torch

from icekv.errors import ConfigError
from icekv.model import ModelArgs
from icekv.model.weights import stored_apart


def hf_config(args: ModelArgs) -> dict:
    """A ``config.json`` dict for a Llama-architecture :class:`ModelArgs`."""
    rope = args.rope_scaling or {"rope_type": "default"}  # its own rope_type included
    return {
        "architectures": [args.architecture], "model_type": "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers, "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim, "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": {"rope_theta": args.rope_theta, **rope},
        "max_position_embeddings": args.max_position_embeddings, "tie_word_embeddings": args.tie_word_embeddings,
        "attention_bias": args.qkv_bias,
    }


def hf_model(engine) -> torch.nn.Module:
    """transformers' model of the engine's weights, on the engine's device and in its dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = engine.cache.dtype
    if stored_apart(engine.weights, str(dtype).removeprefix("torch.")):
        raise ConfigError(f"the transformers peer runs the checkpoint's weights, not {engine.weights} ones: "
                          "compare it with --weights auto")
    if engine.model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=dtype).to(engine.device).eval()
    config = LlamaConfig(**hf_config(engine.model.args))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v
             for k, v in engine.model.state_dict().items()}  # the same tensors: no second copy
    model.load_state_dict(state, assign=True, strict=False)
    with torch.device(engine.device):  # its buffers were on meta (and are not in a state dict)
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.to(dtype).eval()
