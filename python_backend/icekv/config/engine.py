"""The engine's settings: where it runs, its model, how it schedules requests, and the paging and
selection configs it holds."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
# how linear weights are stored (icekv.model.weights); auto: in the compute dtype
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
KV_POOLS = ("auto", "host", "device")  # where the KV page pool lives, see EngineConfig
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def default_cache_dir() -> Path:
    """Where fetched models and texts live: ``$ICEKV_CACHE`` or ``~/.cache/icekv``."""
    return Path(os.environ.get("ICEKV_CACHE") or Path.home() / ".cache" / "icekv")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the engine shares its steps among requests (continuous batching, chunked prefill).

    Each step runs one decode token of every running request plus prefill chunks of the others,
    up to ``max_step_tokens`` tokens in all: a long prompt holds the others' next tokens for at
    most one step. A request is admitted (FIFO) when its worst case fits in what the running ones
    have not been promised: KV pages (prompt + max_tokens), page-index host memory
    (``max_index_bytes``, None: the pool's size in the model's dtype), compressed-context bytes
    (``max_context_bytes``, None: the same) and, when the pool is off the compute device,
    the device memory requests hold beside the model (``max_device_bytes``, None: 90% of what is
    free once the engine is loaded; see :func:`icekv.sizing.device_need`: a prefill keeps every
    global layer's K/V of its prompt there and about a local layer's window, a decode under a
    budget far less). One that could never fit is refused at submit.
    """

    max_active_requests: int = 8  # requests in prefill or decode at once
    max_queued_requests: int = 64  # waiting for memory or a turn; beyond this: busy
    max_step_tokens: int = 512  # tokens per engine step: every running decode + prefill chunks
    max_index_bytes: int | None = None
    max_context_bytes: int | None = None
    max_device_bytes: int | None = None
    max_queue_wait_s: float = 120.0  # a request queued longer is refused as busy

    def __post_init__(self) -> None:
        if self.max_queue_wait_s <= 0:
            raise ConfigError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")
        if self.max_active_requests < 1 or self.max_queued_requests < 0:
            raise ConfigError("max_active_requests must be >= 1 and max_queued_requests >= 0")
        if self.max_step_tokens <= self.max_active_requests:
            raise ConfigError(f"max_step_tokens ({self.max_step_tokens}) must exceed max_active_requests "
                              f"({self.max_active_requests}): every running decode and some prefill fit in one step")
        for name in ("max_index_bytes", "max_context_bytes", "max_device_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load a model and run requests on it.

    ``model_dir`` None means the embedded default model (SmolLM2-135M-Instruct) from the asset
    cache, fetched on first use; ``random_weights`` names a model shape (:mod:`icekv.model.random`)
    whose weights are drawn at random instead, for benchmarks where no weights can be fetched.

    ``device``: where weights, activations, attention and the device page slots live (``auto``:
    the first CUDA device when there is one). ``kv_pool``: where the page pool that owns every
    token lives: ``host`` (CPU memory, pinned when computing on a GPU; IceCache moves only the
    selected pages to the device), ``device`` (full attention reads it in place), or ``auto``:
    host under a sparse default policy, device under full attention. On a CPU both are the same.
    """

    model_dir: str | None = None
    random_weights: str | None = None
    device: str = "auto"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU (dtype_on)
    weights: str = "auto"  # WEIGHT_FORMATS: how linear weights are stored and multiplied (weights_on)
    allow_extra_weights: bool = False  # skip checkpoint tensors the model has no place for (icekv.model.loader)
    kv_pool: str = "auto"
    paging: PagingConfig = field(default_factory=PagingConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefill_chunk_tokens: int = 512  # the most prompt tokens of one request in one step
    num_threads: int | None = None
    # threads that build a sparse policy's index during prefill; 0: the first decode builds it after
    # prefill; None: the cores the forward pass leaves free (0 where it uses them all: on shared
    # cores the build slows prefill by about what it saves)
    index_threads: int | None = None
    # threads running a decode step's page searches of one layer, a request each; 0 or 1: one after another
    search_threads: int = 0

    def __post_init__(self) -> None:
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.kv_pool not in KV_POOLS:
            raise ConfigError(f"kv_pool must be one of {', '.join(KV_POOLS)}, got {self.kv_pool!r}")
        if self.model_dir is not None and self.random_weights is not None:
            raise ConfigError("model_dir and random_weights exclude each other: give one")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(
                f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.index_threads is not None and self.index_threads < 0:
            raise ConfigError(f"index_threads must be >= 0, got {self.index_threads}")
        if self.search_threads < 0:
            raise ConfigError(f"search_threads must be >= 0, got {self.search_threads}")
        if self.selection.page_size != self.paging.page_size:
            raise ConfigError(
                f"selection.page_size {self.selection.page_size} differs from paging.page_size "
                f"{self.paging.page_size}"
            )

    def dtype_on(self, device_type: str) -> str:
        """The dtype setting, or its default on this kind of device."""
        return self.dtype or ("bfloat16" if device_type == "cuda" else "float32")

    def weights_on(self, device_type: str) -> str:
        """The weights setting, ``auto`` resolved to the compute dtype on this kind of device; float32
        weights need the float32 compute dtype."""
        dtype = self.dtype_on(device_type)
        if self.weights == "float32" and dtype != "float32":
            raise ConfigError(f"float32 weights need the float32 dtype, and the dtype is {dtype} on {device_type}")
        return dtype if self.weights == "auto" else self.weights

    def pool_placement(self, sparse_default: bool) -> str:
        """``host`` or ``device``: the ``kv_pool`` setting, ``auto`` decided by whether the default
        policy is sparse (``sparse_default``)."""
        if self.kv_pool != "auto":
            return self.kv_pool
        return "host" if sparse_default else "device"
