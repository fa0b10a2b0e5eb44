"""Frozen configuration dataclasses: the one place every icekv default is written.

Each config validates itself in ``__post_init__`` and raises :class:`ConfigError` with a message
that names the offending field, so the CLI and the server can show it to the user as is.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from icekv.config_paths import build_config
from icekv.errors import ConfigError
from icekv.method_settings import (CENTROID_SCORING, GQA_MERGES, RESCORING, SCORE_DTYPES, SEARCHES,  # noqa: F401
                                   ArkValeConfig, IceCacheConfig, MagicPIGConfig, OmniKVConfig, PQCacheConfig,
                                   SnapKVConfig)
from icekv.request_config import MAX_TOP_LOGPROBS, PromptCaching, SamplingConfig  # noqa: F401

DTYPES = ("float32", "bfloat16", "float16")
KV_POOLS = ("auto", "host", "device")  # where the KV page pool lives, see EngineConfig
KV_DTYPES = ("auto", "int8", "fp8_e4m3")  # how KV pages are stored, see PagingConfig
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def default_cache_dir() -> Path:
    """Where fetched models and texts live: ``$ICEKV_CACHE`` or ``~/.cache/icekv``."""
    return Path(os.environ.get("ICEKV_CACHE") or Path.home() / ".cache" / "icekv")


@dataclass(frozen=True)
class PagingConfig:
    """Layout of the paged KV cache shared by every layer.

    ``max_context_tokens`` sizes the preallocated page pool (per layer); a request whose prompt
    plus generated tokens would exceed it is refused up front rather than failing mid-decode.
    ``prefix_cache``: a finished request's full pages stay in the pool, for a later prompt that
    starts with the same tokens (a chat's next turn), until the pool needs their room.
    ``kv_dtype``: how pages are stored (the pool, the device slots, stored compressed contexts):
    ``auto`` in the model's dtype, or ``int8`` / ``fp8_e4m3`` codes with a float32 scale per token
    and KV head (:mod:`icekv.kv.quant`).
    """

    page_size: int = 16
    max_context_tokens: int = 32768
    prefix_cache: bool = True
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_context_tokens < self.page_size:
            raise ConfigError(
                f"max_context_tokens ({self.max_context_tokens}) must hold at least one page "
                f"of {self.page_size} tokens"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")

    @property
    def num_pages(self) -> int:
        """Pages per layer in the preallocated pool."""
        return math.ceil(self.max_context_tokens / self.page_size)


@dataclass(frozen=True)
class SelectionConfig:
    """Which tokens each decode step attends to.

    ``budget`` is tokens attended per layer per KV head, sink and window included; the first
    ``n_unlimited_layers`` layers keep their full cache. ``full`` ignores the budget. Sink and
    window default to 2 pages each (the paper's setting), shrunk to a quarter of the budget's pages
    each for small budgets (64 tokens: 1 + 1 pages, 2 selected) so selection always has room.
    """

    policy: str = "full"  # a name in icekv.policies; the server's profile (serving_engine) picks icecache
    budget: int = 256
    page_size: int = 16
    n_sink_pages: int | None = None
    n_win_pages: int | None = None
    n_unlimited_layers: int = 2
    icecache: IceCacheConfig = field(default_factory=IceCacheConfig)
    # the baselines' own settings (icekv.method_settings)
    arkvale: ArkValeConfig = field(default_factory=ArkValeConfig)
    pqcache: PQCacheConfig = field(default_factory=PQCacheConfig)
    magicpig: MagicPIGConfig = field(default_factory=MagicPIGConfig)
    omnikv: OmniKVConfig = field(default_factory=OmniKVConfig)
    snapkv: SnapKVConfig = field(default_factory=SnapKVConfig)

    def __post_init__(self) -> None:
        default_pages = max(1, min(2, self.budget // self.page_size // 4))
        if self.n_sink_pages is None:
            object.__setattr__(self, "n_sink_pages", default_pages)
        if self.n_win_pages is None:
            object.__setattr__(self, "n_win_pages", default_pages)
        if self.budget < 1:
            raise ConfigError(f"budget must be >= 1 token, got {self.budget}")
        if self.n_sink_pages < 0 or self.n_win_pages < 1 or self.n_unlimited_layers < 0:
            raise ConfigError("n_sink_pages must be >= 0, n_win_pages >= 1, n_unlimited_layers >= 0")

    def check_paged_budget(self) -> None:
        """A policy that selects pages needs a budget of whole pages with room past its sink and
        window (the registry calls this for the sparse policies: :func:`icekv.policies.resolve`)."""
        if self.budget % self.page_size:
            raise ConfigError(f"budget {self.budget} is not a multiple of the page size {self.page_size}")
        fixed = (self.n_sink_pages + self.n_win_pages) * self.page_size
        if self.budget <= fixed:
            raise ConfigError(
                f"budget {self.budget} must exceed sink + window = {fixed} tokens "
                f"({self.n_sink_pages} + {self.n_win_pages} pages of {self.page_size})"
            )

    @property
    def selected_pages(self) -> int:
        """Pages picked per step per KV head, besides sink and window."""
        return self.budget // self.page_size - self.n_sink_pages - self.n_win_pages


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
    layer's K/V of its prompt there, a decode under a budget far less). One that could never fit
    is refused at submit.
    """

    max_running: int = 8  # requests in prefill or decode at once
    max_waiting: int = 64  # waiting for memory or a turn; beyond this: busy
    max_step_tokens: int = 512  # tokens per engine step: every running decode + prefill chunks
    max_index_bytes: int | None = None
    max_context_bytes: int | None = None
    max_device_bytes: int | None = None
    max_queue_wait_s: float = 120.0  # a request queued longer is refused as busy

    def __post_init__(self) -> None:
        if self.max_queue_wait_s <= 0:
            raise ConfigError(f"max_queue_wait_s must be > 0, got {self.max_queue_wait_s}")
        if self.max_running < 1 or self.max_waiting < 0:
            raise ConfigError("max_running (max_active_requests) must be >= 1 and max_waiting "
                              "(max_queued_requests) >= 0")
        if self.max_step_tokens <= self.max_running:
            raise ConfigError(f"max_step_tokens ({self.max_step_tokens}) must exceed max_running "
                              f"({self.max_running}): every running decode and some prefill fit in one step")
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

    def pool_placement(self, sparse_default: bool) -> str:
        """``host`` or ``device``: the ``kv_pool`` setting, ``auto`` decided by whether the default
        policy is sparse (``sparse_default``)."""
        if self.kv_pool != "auto":
            return self.kv_pool
        return "host" if sparse_default else "device"


# The server's profile: what it changes of the engine's defaults (EngineConfig field paths). A served
# model is there for long contexts: IceCache is its default policy, searched by centroid (higher
# recall than the paper's walk for fewer reads: bench/selection_recall.py); the library and the eval
# default to the full cache, so nothing is approximated unless asked.
SERVING_PROFILE = {"selection.policy": "icecache", "selection.icecache.search": "centroids"}


def serving_engine() -> EngineConfig:
    """The engine under the server's profile (:data:`SERVING_PROFILE`)."""
    return build_config(EngineConfig, SERVING_PROFILE)


def check_kv_budget(value: float, name: str = "kv_budget") -> None:
    """A share of a context's KV to keep must be in (0, 1] (ConfigError naming ``name`` otherwise)."""
    if not (0 < value <= 1):
        raise ConfigError(f"{name} must be in (0, 1], got {value:g}")


@dataclass(frozen=True)
class CompressionConfig:
    """Compressing reusable contexts (``icekv compress``, and the server's ``context`` requests)."""

    method: str = "kv2"
    kv_budget: float = 0.05  # share of the context's KV kept
    max_tokens: int = 32768  # the longest context the server compresses
    kv2: str = ""  # the kv2 method's settings, "NAME=VALUE,..." (its dataclass fields; empty: its defaults)

    def __post_init__(self) -> None:
        check_kv_budget(self.kv_budget)
        if self.max_tokens < 1:
            raise ConfigError(f"max_compress_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class ServingConfig:
    """The Triton model's settings: the engine plus request admission limits.

    Filled from the ``parameters`` of ``config.pbtxt`` by :func:`icekv.settings.serving_config`.
    """

    engine: EngineConfig = field(default_factory=serving_engine)
    default_max_tokens: int = 128
    max_tokens_limit: int = 4096
    store: str | None = None  # context store: a directory or redis://host:port; None: no store
    store_max_bytes: int = 8 << 30
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    max_stop_sequences: int = 4  # stop strings per request, as the OpenAI API allows ...
    max_stop_chars: int = 128  # ... and each one's length: every token is checked against them
    max_input_bytes: int = 4 << 20  # text_input, messages or context: larger ones are refused before tokenizing
    max_cache_retention_s: float = 600.0  # the longest cache_retention_s a request may ask
    prefix_cache_spill: bool = False  # the prefix cache's pages also written to the store, read back on a miss

    def __post_init__(self) -> None:
        if self.prefix_cache_spill and not self.store:
            raise ConfigError("prefix_cache_spill needs a store (store: a directory or redis://...)")
        if self.prefix_cache_spill and not self.engine.paging.prefix_cache:
            raise ConfigError("prefix_cache_spill needs the prefix cache (prefix_cache true)")
        if not (1 <= self.default_max_tokens <= self.max_tokens_limit):
            raise ConfigError("default_max_tokens must be in 1..max_tokens_limit")
