"""Model hyper-parameters read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from icekv.errors import ModelLoadError

# architecture name -> (per-projection q/k/v bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


def _sliding_window(cfg: dict) -> int | None:
    """The attention window a config turns on for some of its layers, or None: Mistral's
    ``sliding_window``, unless Qwen's ``use_sliding_window`` switch is off, ``layer_types`` names
    no sliding layer, or (without ``layer_types``) Qwen's ``max_window_layers`` leaves none past it."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if cfg.get("max_window_layers", 0) >= cfg["num_hidden_layers"]:  # layers from this index on slide
        return None
    return int(window)


@dataclass(frozen=True)
class ModelArgs:
    """The shape and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    # the window of past tokens some layers attend (Mistral v0.1: 4096); None: every layer attends
    # its whole context. icekv does not apply windows yet: the engine keeps requests within one.
    sliding_window: int | None = None

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; icekv runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ModelLoadError(f"unsupported rope_type {rope_type!r} (icekv: default, llama3)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=default_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(cfg),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelArgs":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model directory {model_dir}")
        cfg = json.loads(path.read_text())
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():  # generation_config's eos list is authoritative when present
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg = {**cfg, "eos_token_id": eos}
        return cls.from_hf_config(cfg)
