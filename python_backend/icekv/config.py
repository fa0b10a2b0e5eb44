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

from icekv.errors import ConfigError
from icekv.method_settings import ArkValeConfig, MagicPIGConfig, OmniKVConfig, PQCacheConfig, SnapKVConfig

DTYPES = ("float32", "bfloat16", "float16")
KV_POOLS = ("auto", "host", "device")  # where the KV page pool lives, see EngineConfig
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
SCORE_DTYPES = ("auto", "float32", "bfloat16", "int8")  # the IceCache index's page keys, see icekv.index.score_rows


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


SEARCHES = ("walk", "exhaustive", "centroids")  # IceCache page searches
CENTROID_SCORING = ("auto", "host", "device")  # where the centroids search scores the centroids
RESCORING = ("host", "device")  # where the centroids search rescores its candidates


@dataclass(frozen=True)
class IceCacheConfig:
    """DCI-tree settings (IceCache paper defaults) and how a decode step searches the tree.

    About ``ratio_1`` of indexed tokens are promoted to level 1 and ``ratio_2`` of each level one
    level higher, deterministically in sequence order. The page search (``search``):

    - ``walk``: the paper's top-down walk, keeping the best ``max(fov_fraction * seq_len, fov_min)``
      nodes per level; reads about a quarter of the keys at any length with these defaults.
    - ``exhaustive``: every page scored exactly (the walk with an unlimited field of view).
    - ``centroids``: every page ranked by ``q.centroid`` (one vector per page), each query head's
      best ``candidates(k)`` pages rescored exactly. Higher recall than the walk for a fraction
      of the reads (bench/selection_recall.py); the served model's default.

    ``score_dtype``: the dtype of the index's page keys (its only copy of them) and centroids.
    ``auto`` (the default, :meth:`page_keys`) follows the KV: bf16 keys under a bf16 or fp16 KV
    cache, fp32 under fp32, so the index never holds its keys wider than the KV it indexes (fp32
    keys over a bf16 pool make the index about 1.4x the pool on Llama-3.1-8B's shape). bf16 keys
    halve the index memory and search bytes; the compiled walk and centroids searches widen them to
    fp32, the exhaustive search (torch) rounds q to bf16; selection recall at 8k was 94.7% against
    fp32's 95.2% (bench/selection_recall.py). ``int8`` stores each key as int8 values with its own
    fp32 scale (max |value| / 127: nothing clips), about a quarter of fp32's bytes; every search
    scores with the decoded keys (:mod:`icekv.index.score_rows`).

    ``centroid_scoring``: where the centroids search ranks the pages by centroid. ``device``: a
    copy of the centroids in the compute dtype on the compute device (1 / (2 * page_size) of the
    full KV's bytes) is scored there and only the candidates' ids come to the host, which rescores
    them exactly (the host no longer reads every centroid each step: that read grows with the
    context); ``host``: the host reads them, and device memory stays flat in the context length;
    ``auto``: device on a GPU, host on a CPU.

    ``rescoring``: where the centroids search rescores its candidates exactly. ``host``: from the
    index's page keys (each step reads every candidate's); ``device``: from a cache of recent
    candidates' keys on the compute device (up to ``G * candidates(k)`` pages per KV head and
    layer in the compute dtype, flat in the context length), refilled only with the pages it
    lacks; the centroids are then scored there too. For a GPU: on a CPU the "device" scoring is
    the kernels' torch reference, slower than the host's compiled search.
    """

    ratio_1: float = 0.02
    ratio_2: float = 0.2
    max_level: int = 4
    fov_min: int = 30
    fov_fraction: float = 1.5e-3
    layer_group: int = 3  # icecache_r: layers per group sharing one index
    seed: int = 0  # the random projection that orders a node's children
    search: str = "walk"  # "walk" (the paper's tree walk) | "exhaustive" (every page exactly) | "centroids"
    rerank: int = 8  # centroids search: pages rescored exactly per query head, as a multiple of k,
    min_candidates: int = 96  # and at least this many (small k needs a floor: 2 x 8 misses pages)
    score_dtype: str = "auto"  # the index's page keys: "auto" (the KV's width, see page_keys) | "float32" |
    # "bfloat16" (half fp32's memory) | "int8" (about a quarter)
    centroid_scoring: str = "auto"  # centroids search: "auto" | "host" | "device" (see above)
    rescoring: str = "host"  # centroids search: "host" | "device" (see above)

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ConfigError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.centroid_scoring not in CENTROID_SCORING:
            raise ConfigError(f"centroid_scoring must be one of {', '.join(CENTROID_SCORING)}, "
                              f"got {self.centroid_scoring!r}")
        if self.rescoring not in RESCORING:
            raise ConfigError(f"rescoring must be one of {', '.join(RESCORING)}, got {self.rescoring!r}")
        if self.rescoring == "device" and self.centroid_scoring == "host":
            raise ConfigError("rescoring 'device' needs the centroids scored on the device too: "
                              "centroid_scoring 'host' contradicts it")
        for name in ("centroid_scoring", "rescoring"):
            if getattr(self, name) == "device" and self.search != "centroids":
                raise ConfigError(f"{name} 'device' applies to search 'centroids' only; the {self.search!r} "
                                  "search scores on the host")
        if self.rerank < 1 or self.min_candidates < 1:
            raise ConfigError(f"rerank and min_candidates must be >= 1, got {self.rerank}, {self.min_candidates}")
        if self.score_dtype not in SCORE_DTYPES:
            raise ConfigError(f"score_dtype must be one of {', '.join(SCORE_DTYPES)}, got {self.score_dtype!r}")
        if not (0 < self.ratio_1 <= 0.5):
            raise ConfigError(f"ratio_1 must be in (0, 0.5], got {self.ratio_1}")
        if not (0 < self.ratio_2 <= 0.5):
            raise ConfigError(f"ratio_2 must be in (0, 0.5], got {self.ratio_2}")
        if self.max_level < 1 or self.fov_min < 1 or self.layer_group < 1:
            raise ConfigError("max_level, fov_min and layer_group must be >= 1")

    def page_keys(self, kv_dtype) -> str:
        """The page keys' dtype over a KV cache of ``kv_dtype`` (a torch dtype or its name):
        ``score_dtype``, with ``auto`` bfloat16 for a bf16 or fp16 KV (fp16 keys have no format
        of their own: bf16's are as wide) and float32 for an fp32 one."""
        if self.score_dtype != "auto":
            return self.score_dtype
        return "bfloat16" if str(kv_dtype).removeprefix("torch.") in ("bfloat16", "float16") else "float32"

    def candidates(self, k: int) -> int:
        """Pages per query head the centroids search rescores exactly, to select ``k``."""
        return max(self.rerank * k, self.min_candidates)

    def scores_centroids_on_device(self, device_type: str) -> bool:
        """Does the search rank pages by centroid on the compute device (of type ``device_type``)?"""
        if self.search != "centroids":
            return False
        return (self.centroid_scoring == "device" or self.rescoring == "device"
                or (self.centroid_scoring == "auto" and device_type == "cuda"))

    def rescores_on_device(self) -> bool:
        """Does the search rescore its candidates on the compute device?"""
        return self.search == "centroids" and self.rescoring == "device"

    def field_of_view(self, seq_len: int) -> int:
        return max(int(self.fov_fraction * seq_len), self.fov_min)


@dataclass(frozen=True)
class SelectionConfig:
    """Which tokens each decode step attends to.

    ``budget`` is tokens attended per layer per KV head, sink and window included; the first
    ``n_unlimited_layers`` layers keep their full cache. ``full`` ignores the budget. Sink and
    window default to 2 pages each (the paper's setting), shrunk to a quarter of the budget's pages
    each for small budgets (64 tokens: 1 + 1 pages, 2 selected) so selection always has room.
    """

    policy: str = "full"  # the engine default; the Triton model repository defaults to icecache
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
        policy = self._policy()  # an unknown name is a ConfigError naming the known ones
        if self.budget < 1:
            raise ConfigError(f"budget must be >= 1 token, got {self.budget}")
        if self.n_sink_pages < 0 or self.n_win_pages < 1 or self.n_unlimited_layers < 0:
            raise ConfigError("n_sink_pages must be >= 0, n_win_pages >= 1, n_unlimited_layers >= 0")
        if not policy.sparse:
            return
        if self.budget % self.page_size:
            raise ConfigError(f"budget {self.budget} is not a multiple of the page size {self.page_size}")
        fixed = (self.n_sink_pages + self.n_win_pages) * self.page_size
        if self.budget <= fixed:
            raise ConfigError(
                f"budget {self.budget} must exceed sink + window = {fixed} tokens "
                f"({self.n_sink_pages} + {self.n_win_pages} pages of {self.page_size})"
            )

    def _policy(self):
        from icekv.policies import get_policy  # the registry; imported here because it imports this module

        return get_policy(self.policy)

    @property
    def attended_budget(self) -> int | None:
        """The budget, or None under a policy that attends every token (``full``)."""
        return self.budget if self._policy().sparse else None

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
    (``max_index_bytes``, None: the pool's size), compressed-context bytes
    (``max_context_bytes``, None: the pool's size) and, when the pool is off the compute device,
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
        if self.selection.page_size != self.paging.page_size:
            raise ConfigError(
                f"selection.page_size {self.selection.page_size} differs from paging.page_size "
                f"{self.paging.page_size}"
            )

    def dtype_on(self, device_type: str) -> str:
        """The dtype setting, or its default on this kind of device."""
        return self.dtype or ("bfloat16" if device_type == "cuda" else "float32")

    def pool_placement(self) -> str:
        """``host`` or ``device``: the ``kv_pool`` setting with ``auto`` decided by the default policy."""
        if self.kv_pool != "auto":
            return self.kv_pool
        return "host" if self.selection.attended_budget is not None else "device"


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
        self.method_settings()  # a bad settings string fails here

    def method_settings(self) -> dict[str, dict]:
        """method -> its settings (only kv2 has server-wide ones)."""
        from icekv.compress import parse_settings

        return {"kv2": parse_settings("kv2", self.kv2)}


@dataclass(frozen=True)
class ServingConfig:
    """The Triton model's settings: the engine plus request admission limits.

    Filled from the ``parameters`` of ``config.pbtxt`` by :meth:`from_triton_parameters`.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    default_max_tokens: int = 128
    max_tokens_limit: int = 4096
    store: str | None = None  # context store: a directory or redis://host:port; None: no store
    store_max_bytes: int = 8 << 30
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    max_stop_sequences: int = 4  # stop strings per request, as the OpenAI API allows ...
    max_stop_chars: int = 128  # ... and each one's length: every token is checked against them
    max_input_bytes: int = 4 << 20  # text_input, messages or context: larger ones are refused before tokenizing

    def __post_init__(self) -> None:
        if not (1 <= self.default_max_tokens <= self.max_tokens_limit):
            raise ConfigError("default_max_tokens must be in 1..max_tokens_limit")

    @classmethod
    def from_triton_parameters(cls, params: dict) -> "ServingConfig":
        """``params``: config.pbtxt parameters, ``{key: {"string_value": ...}}`` or plain strings."""
        values = {k: (v.get("string_value") if isinstance(v, dict) else v) for k, v in params.items()}
        values = {k: v for k, v in values.items() if v not in (None, "")}
        known = {"model_dir", "dtype", "policy", "budget", "search", "score_dtype", "page_size", "host_pool_tokens",
                 "prefill_chunk_tokens", "num_threads", "index_threads", "max_active_requests", "max_queued_requests",
                 "max_step_tokens", "default_max_tokens", "max_tokens_limit", "store", "store_max_bytes",
                 "max_index_bytes", "max_context_bytes", "max_device_bytes", "max_compress_tokens",
                 "max_queue_wait_s", "kv2", "device", "kv_pool", "centroid_scoring", "rescoring"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model parameters {unknown}; known: {sorted(known)}")

        def number(key: str, default, kind=int):
            if key not in values:
                return default
            try:
                return kind(values[key])
            except ValueError:
                raise ConfigError(f"parameter {key} must be {'an integer' if kind is int else 'a number'}, "
                                  f"got {values[key]!r}") from None

        paging = PagingConfig(
            page_size=number("page_size", PagingConfig.page_size),
            max_context_tokens=number("host_pool_tokens", PagingConfig.max_context_tokens),
        )
        selection = SelectionConfig(
            policy=values.get("policy", SelectionConfig.policy),
            budget=number("budget", SelectionConfig.budget),
            page_size=paging.page_size,
            icecache=IceCacheConfig(search=values.get("search", IceCacheConfig.search),
                                    score_dtype=values.get("score_dtype", IceCacheConfig.score_dtype),
                                    centroid_scoring=values.get("centroid_scoring", IceCacheConfig.centroid_scoring),
                                    rescoring=values.get("rescoring", IceCacheConfig.rescoring)),
        )
        scheduler = SchedulerConfig(
            max_running=number("max_active_requests", SchedulerConfig.max_running),
            max_waiting=number("max_queued_requests", SchedulerConfig.max_waiting),
            max_step_tokens=number("max_step_tokens", SchedulerConfig.max_step_tokens),
            max_index_bytes=number("max_index_bytes", SchedulerConfig.max_index_bytes),
            max_context_bytes=number("max_context_bytes", SchedulerConfig.max_context_bytes),
            max_device_bytes=number("max_device_bytes", SchedulerConfig.max_device_bytes),
            max_queue_wait_s=number("max_queue_wait_s", SchedulerConfig.max_queue_wait_s, float),
        )
        engine = EngineConfig(
            model_dir=values.get("model_dir"),
            device=values.get("device", EngineConfig.device),
            dtype=values.get("dtype", EngineConfig.dtype),
            kv_pool=values.get("kv_pool", EngineConfig.kv_pool),
            paging=paging,
            selection=selection,
            scheduler=scheduler,
            prefill_chunk_tokens=number("prefill_chunk_tokens", EngineConfig.prefill_chunk_tokens),
            num_threads=number("num_threads", None),
            index_threads=number("index_threads", None),
        )
        return cls(
            engine=engine,
            default_max_tokens=number("default_max_tokens", cls.default_max_tokens),
            max_tokens_limit=number("max_tokens_limit", cls.max_tokens_limit),
            store=values.get("store"),
            store_max_bytes=number("store_max_bytes", cls.store_max_bytes),
            compression=CompressionConfig(max_tokens=number("max_compress_tokens", CompressionConfig.max_tokens),
                                          kv2=values.get("kv2", CompressionConfig.kv2)),
        )


@dataclass(frozen=True)
class OpenAIConfig:
    """icekv's HTTP frontend (the OpenAI API and Triton's generate extension): where it listens,
    which Triton model it forwards to, its limits."""

    triton_grpc_url: str = "127.0.0.1:8001"
    model: str = "icekv"  # the Triton model, and the model id clients name
    host: str = "127.0.0.1"
    port: int = 9000
    extra_ports: tuple[int, ...] = ()  # more ports serving the same routes (icekv serve: the HTTP port)
    max_body_bytes: int = 4 << 20  # larger bodies get a 413 before they are read
    max_stop_sequences: int = ServingConfig.max_stop_sequences
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for port in (self.port, *self.extra_ports):
            if not (1 <= port <= 65535):
                raise ConfigError(f"port must be in 1..65535, got {port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_stop_sequences < 0:
            raise ConfigError(f"max_stop_sequences must be >= 0, got {self.max_stop_sequences}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
