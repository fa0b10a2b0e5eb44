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
    "Gemma3ForCausalLM": (False, True),
}
REFUSED_ARCHITECTURES = {  # known families icekv does not run, and why
    "Gemma2ForCausalLM": "Gemma 2 soft-caps its attention logits, which icekv's attention kernels do not",
    "Gemma3ForConditionalGeneration": "this is Gemma 3's image-text checkpoint; icekv runs the text-only "
                                      "Gemma3ForCausalLM (model_type gemma3_text)",
}
GEMMA_SLIDING_PATTERN = 6  # Gemma 3 without ``layer_types``: every sixth layer is global


def _local_layers(cfg: dict) -> tuple[int, ...]:
    """The layers that attend a sliding window: those ``layer_types`` names ``sliding_attention``;
    without it, Gemma 3's pattern, or every layer from Qwen's ``max_window_layers`` on (0 for
    Mistral); none where ``sliding_window`` is unset or Qwen's ``use_sliding_window`` is off."""
    n = cfg["num_hidden_layers"]
    if not cfg.get("sliding_window") or cfg.get("use_sliding_window") is False:
        return ()
    if cfg.get("layer_types") is not None:
        return tuple(i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention")
    if cfg.get("model_type") == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", GEMMA_SLIDING_PATTERN)
        return tuple(i for i in range(n) if (i + 1) % pattern)
    return tuple(range(cfg.get("max_window_layers", 0), n))


def _rope(params: dict, default_theta: float) -> tuple[float, dict | None]:
    """(base, scaling) of one RoPE parameter set; scaling None for plain RoPE."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3", "linear"):
        raise ModelLoadError(f"unsupported rope_type {kind!r} (icekv: default, llama3, linear)")
    return theta, ({**params, "rope_type": kind} if kind != "default" else None)


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
    # the tokens a local layer attends, its query's own included (Mistral v0.1: 4096, every layer)
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()  # the layers that attend only ``sliding_window`` tokens
    # Gemma 3: local layers' own RoPE base; the pre-attention query scale (scores * scalar^-0.5);
    # norms that scale by (1 + weight), with a norm after attention and around the MLP; the
    # embedding scaled by sqrt(hidden_size); GeGLU ("gelu_tanh") in place of SwiGLU ("silu")
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    gemma_norms: bool = False
    mlp_activation: str = "silu"

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The tokens ``layer`` attends back from each query (its own included); None: all of them."""
        return self.sliding_window if layer in self.local_layers else None

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers that attend every token: the only ones a sparse policy selects in."""
        return tuple(i for i in range(self.num_layers) if i not in self.local_layers)

    @property
    def takes_contexts(self) -> bool:
        """Can it attend a compressed context? Those keep tokens across every layer's whole
        context, which a sliding-window layer does not attend."""
        return not self.local_layers

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """:meth:`window` of every layer, in order (what the KV cache reads its layers by)."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        refused = next((a for a in archs if a in REFUSED_ARCHITECTURES), None)
        if arch is None and refused is not None:
            raise ModelLoadError(f"unsupported architecture {refused}: {REFUSED_ARCHITECTURES[refused]}")
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; icekv runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        gemma = arch == "Gemma3ForCausalLM"
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        local_rope_theta = None
        if "full_attention" in rope:  # one parameter set per layer type (Gemma 3 in transformers 5)
            local_rope_theta, local_scaling = _rope(rope.get("sliding_attention"), 10000.0)
            if local_scaling is not None:
                raise ModelLoadError("unsupported RoPE scaling on sliding-window layers")
            rope = rope["full_attention"]
        elif gemma:
            local_rope_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        rope_theta, rope_scaling = _rope(rope, cfg.get("rope_theta", 10000.0))
        if cfg.get("attn_logit_softcapping") or cfg.get("final_logit_softcapping"):
            raise ModelLoadError("unsupported logit soft-capping (attn_logit_softcapping, final_logit_softcapping)")
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported MLP activation {activation!r} (icekv: silu, gelu_pytorch_tanh)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = cfg["num_attention_heads"]
        local_layers = _local_layers(cfg)
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
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),  # Gemma ties by default
            qkv_bias=default_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
            sliding_window=int(cfg["sliding_window"]) if local_layers else None,
            local_layers=local_layers,
            local_rope_theta=local_rope_theta if local_layers else None,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
            gemma_norms=gemma,
            mlp_activation="gelu_tanh" if activation == "gelu_pytorch_tanh" else "silu",
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
