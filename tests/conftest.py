"""Shared fixtures: the real default model (fetched once into ICEKV_CACHE) and tiny HF models."""

from __future__ import annotations

import os

import pytest
import torch

from icekv.assets import Assets
from icekv.devices import use_huge_pages

use_huge_pages()  # as the CLI and the server run: set before the first tensor

# Kernel tests on CPU run triton's interpreter, which must be chosen before anything imports triton
# (its functions are decorated at import). Set here, as this file loads: pytest imports the
# conftests of the paths it is given (tests/serving's imports reach triton) before any
# pytest_configure hook runs. Off for ICEKV_TEST_DEVICE=cuda.
if os.environ.get("ICEKV_TEST_DEVICE") != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def assets() -> Assets:
    return Assets()


@pytest.fixture(scope="session")
def smollm2_dir(assets):
    return assets.model_dir()


@pytest.fixture(scope="session")
def engine(smollm2_dir):
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine

    return Engine(EngineConfig(model_dir=str(smollm2_dir)))


@pytest.fixture(scope="session")
def essays_text(assets) -> str:
    return assets.haystack_text("essays")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback (no persistence), for the store and serving tests."""
    from tests.redis_server import start_redis

    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)


TINY_CONFIGS = {
    "llama": dict(
        cls="LlamaForCausalLM", cfg="LlamaConfig",
        extra=dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    ),
    "mistral": dict(cls="MistralForCausalLM", cfg="MistralConfig", extra=dict(sliding_window=None)),
    # every layer attends a window shorter than the tests' prompts
    "mistral-window": dict(cls="MistralForCausalLM", cfg="MistralConfig", extra=dict(sliding_window=24)),
    # local layers with their own RoPE base, a global one with linear RoPE scaling, a query scale
    # other than head_dim^-0.5, GeGLU, Gemma's norms and embedding scale
    "gemma3": dict(cls="Gemma3ForCausalLM", cfg="Gemma3TextConfig", extra=dict(
        head_dim=32, sliding_window=24, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "qwen2": dict(cls="Qwen2ForCausalLM", cfg="Qwen2Config", extra=dict(use_sliding_window=False)),
    "qwen3": dict(cls="Qwen3ForCausalLM", cfg="Qwen3Config", extra=dict(head_dim=32, use_sliding_window=False)),
}


def make_tiny_hf_model(arch: str, path, num_kv_heads: int = 2, vocab_size: int = 512):
    """A random-weight HF model of ``arch`` saved to ``path``; returns the HF model."""
    import transformers

    spec = TINY_CONFIGS[arch]
    config = getattr(transformers, spec["cfg"])(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
        tie_word_embeddings=False, **spec["extra"],
    )
    torch.manual_seed(0)
    model = getattr(transformers, spec["cls"])(config).eval()
    with torch.no_grad():  # non-trivial norms and biases so a missed one changes the output
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model
