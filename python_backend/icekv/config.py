"""Frozen configuration dataclasses: the one place every icekv default is written.

Each config validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message
that names the offending field, so the CLI and the server can show it to the user as is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from icekv.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


def default_cache_dir() -> Path:
    """Where fetched models and texts live: ``$ICEKV_CACHE`` or ``~/.cache/icekv``."""
    return Path(os.environ.get("ICEKV_CACHE") or Path.home() / ".cache" / "icekv")


@dataclass(frozen=True)
class PagingConfig:
    """Layout of the paged KV cache shared by every layer.

    ``max_context_tokens`` sizes the preallocated page pool (per layer); a request whose prompt
    plus generated tokens would exceed it is refused up front rather than failing mid-decode.
    """

    page_size: int = 16
    max_context_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_context_tokens < self.page_size:
            raise ConfigError(
                f"max_context_tokens ({self.max_context_tokens}) must hold at least one page "
                f"of {self.page_size} tokens"
            )

    @property
    def num_pages(self) -> int:
        """Pages per layer in the preallocated pool."""
        return math.ceil(self.max_context_tokens / self.page_size)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked. ``temperature == 0`` means greedy decoding."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and run requests on it.

    ``model_dir`` None means the embedded default model (SmolLM2-135M-Instruct) from the asset
    cache, fetched on first use.
    """

    model_dir: str | None = None
    dtype: str = "float32"
    paging: PagingConfig = field(default_factory=PagingConfig)
    prefill_chunk_tokens: int = 512
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(
                f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
