"""The paged KV cache's layout and capacity, shared by every layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from icekv.errors import ConfigError

KV_DTYPES = ("auto", "int8", "fp8_e4m3")  # how KV pages are stored, see PagingConfig


@dataclass(frozen=True)
class PagingConfig:
    """Layout of the paged KV cache shared by every layer.

    ``pool_tokens`` sizes the preallocated page pool (per layer); a request whose prompt
    plus generated tokens would exceed it is refused up front rather than failing mid-decode.
    ``prefix_cache``: a finished request's full pages stay in the pool, for a later prompt that
    starts with the same tokens (a chat's next turn), until the pool needs their room.
    ``kv_dtype``: how pages are stored (the pool, the device slots, stored compressed contexts):
    ``auto`` in the model's dtype, or ``int8`` / ``fp8_e4m3`` codes with a float32 scale per token
    and KV head (:mod:`icekv.kv.quant`).
    """

    page_size: int = 16
    pool_tokens: int = 32768
    prefix_cache: bool = True
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.pool_tokens < self.page_size:
            raise ConfigError(
                f"pool_tokens ({self.pool_tokens}) must hold at least one page "
                f"of {self.page_size} tokens"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")

    @property
    def num_pages(self) -> int:
        """Pages per layer in the preallocated pool."""
        return math.ceil(self.pool_tokens / self.page_size)
