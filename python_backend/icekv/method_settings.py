"""The decode methods' own settings: IceCache's tree and search, and the baselines' with their
authors' defaults.

Each method keeps what is its own here (PQ codebooks, LSH tables, filter layers, the observation
window). What every sparse policy shares (page size, budget, sink and window pages) is
:class:`icekv.config.SelectionConfig`'s, so all policies are compared at the same budget. Where
an author's run differs from the shared region (ArkVale's 32-token pages, MagicPIG's 4 sink and 64
local tokens), icekv keeps the shared one; docs/baselines.md lists those differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from icekv.errors import ConfigError


SCORE_DTYPES = ("auto", "float32", "bfloat16", "int8")  # the IceCache index's page keys, see icekv.index.score_rows
SEARCHES = ("walk", "exhaustive", "centroids")  # IceCache page searches
CENTROID_SCORING = ("auto", "host", "device")  # where the centroids search scores the centroids
RESCORING = ("host", "device")  # where the centroids search rescores its candidates
GQA_MERGES = ("head_order", "score_order")  # how the query heads of a KV head share its pages


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

    ``candidates(k)`` is ``rerank * k`` pages, and at least ``min_candidates``. A page's centroid
    is the mean of its keys, and a needle is a few tokens of its page: its page can rank low by
    centroid while its best token scores high, so a small budget needs a large floor
    (docs/benchmarks.md, "Candidates rescored", measures what the floor keeps and costs).

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

    ``gqa_merge``: how the query heads that share a KV head share its ``k`` pages. Each query head
    ranks the pages; the rankings are interleaved by rank (every head's best page, then every
    head's second, ...) until ``k`` distinct pages are taken. Within a rank, ``head_order`` takes
    the heads in their order (the authors' code), so when ``k`` is below the group size the last
    heads get no page of their own; ``score_order`` takes them best score first, so the few pages
    go to the heads whose best page scores highest. Every search merges the same way.
    docs/benchmarks.md ("The GQA merge") compares the two at small budgets.
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
    min_candidates: int = 256  # and at least this many (see above: small k needs a floor)
    score_dtype: str = "auto"  # the index's page keys: "auto" (the KV's width, see page_keys) | "float32" |
    # "bfloat16" (half fp32's memory) | "int8" (about a quarter)
    centroid_scoring: str = "auto"  # centroids search: "auto" | "host" | "device" (see above)
    rescoring: str = "host"  # centroids search: "host" | "device" (see above)
    gqa_merge: str = "score_order"  # "score_order" | "head_order" (the authors', see above)

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ConfigError(f"search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.centroid_scoring not in CENTROID_SCORING:
            raise ConfigError(f"centroid_scoring must be one of {', '.join(CENTROID_SCORING)}, "
                              f"got {self.centroid_scoring!r}")
        if self.gqa_merge not in GQA_MERGES:
            raise ConfigError(f"gqa_merge must be one of {', '.join(GQA_MERGES)}, got {self.gqa_merge!r}")
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

    @property
    def merges_by_score(self) -> bool:
        """Are a rank's query heads taken best score first (else in head order)?"""
        return self.gqa_merge == "score_order"

    def field_of_view(self, seq_len: int) -> int:
        return max(int(self.fov_fraction * seq_len), self.fov_min)


@dataclass(frozen=True)
class ArkValeConfig:
    """ArkVale (pku-liang/ArkVale): a page digest (its keys' box, shrunk to the mean distance from
    its centre) bounds q.k; the top pages are recalled, the best resident ones stay."""

    groups: int = 1  # n_groups: KV heads ranked together (1: one ranking per layer, the authors' default)
    topk_share: float = 0.5  # page_topks = budget // 2: the share of slots refilled from the ranking each step

    def __post_init__(self) -> None:
        if self.groups < 1 or not 0 < self.topk_share <= 1:
            raise ConfigError("arkvale needs groups >= 1 and topk_share in (0, 1]")


@dataclass(frozen=True)
class PQCacheConfig:
    """PQCache (HugoZHL/PQCache): keys product-quantized per layer and KV head at prefill."""

    sub_vectors: int = 2  # n_subvec: each key split into this many equal parts
    sub_bits: int = 6  # n_subbits: 2**6 = 64 centroids per part
    kmeans_iters: int = 10  # Lloyd iterations (the authors' needle test; their runs pick 3-300 by time)
    recent_ratio: float = 0.5  # share of the selected tokens given to the most recent indexed ones
    seed: int = 0  # the k-means initial rows

    def __post_init__(self) -> None:
        if self.sub_vectors < 1 or self.sub_bits < 1 or self.sub_bits > 8 or self.kmeans_iters < 1:
            raise ConfigError("pqcache needs sub_vectors >= 1, 1 <= sub_bits <= 8 and kmeans_iters >= 1")
        if not 0 <= self.recent_ratio < 1:
            raise ConfigError(f"pqcache recent_ratio must be in [0, 1), got {self.recent_ratio}")

    @property
    def centroids(self) -> int:
        return 2**self.sub_bits


@dataclass(frozen=True)
class MagicPIGConfig:
    """MagicPIG (Infini-AI-Lab/MagicPIG): SimHash tables over mean-centred keys, sampled attention."""

    bits: int = 10  # K: hyperplanes per table
    tables: int = 150  # L
    min_collisions: int = 2  # a key is sampled when it shares the query's bucket in this many tables
    dense: tuple[int, ...] = (0, 16)  # layers attended in full, of a 32-layer model (Llama-3.1-8B's)
    reference_depth: int = 32
    seed: int = 0  # the hyperplanes (one set for every layer and head, as in the authors' code)

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 15 or self.tables < 1 or not 1 <= self.min_collisions <= self.tables:
            raise ConfigError("magicpig needs 1 <= bits <= 15, tables >= 1 and 1 <= min_collisions <= tables")

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        return frozenset(scale_layers(self.dense, self.reference_depth, num_layers))


@dataclass(frozen=True)
class OmniKVConfig:
    """OmniKV (antgroup/OmniKV): a few filter layers attend in full and pick the tokens the layers
    after them attend. Filter layers are given for a 32-layer model and scaled to the depth."""

    filter_layers: tuple[int, ...] = (2, 8, 18)  # do_select_layers of the authors' Llama-3-8B config
    reference_depth: int = 32
    wait_layers: int = 1  # num_wait_load_layers: dense layers after each filter

    def __post_init__(self) -> None:
        if not self.filter_layers or min(self.filter_layers) < 1 or self.wait_layers < 0:
            raise ConfigError("omnikv needs filter layers >= 1 and wait_layers >= 0")

    def filters(self, num_layers: int) -> tuple[int, ...]:
        """The filter layers of a ``num_layers``-deep model (sorted, distinct; never layer 0)."""
        return tuple(f for f in scale_layers(self.filter_layers, self.reference_depth, num_layers) if f > 0) or (1,)

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        """Layers before the first filter, every filter and its wait layers."""
        filters = self.filters(num_layers)
        dense = set(range(filters[0]))
        for f in filters:
            dense.update(range(f, min(f + self.wait_layers + 1, num_layers)))
        return frozenset(dense)


@dataclass(frozen=True)
class SnapKVConfig:
    """SnapKV (FasterDecoding/SnapKV) at decode time: the prompt's last ``window`` queries vote."""

    window: int = 32  # window_size: the observation window (the prompt's last tokens)
    kernel: int = 5  # kernel_size of the 1-D pooling over the votes

    def __post_init__(self) -> None:
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError("snapkv needs window >= 1 and an odd kernel >= 1")


def scale_layers(layers: tuple[int, ...], reference_depth: int, num_layers: int) -> tuple[int, ...]:
    """Layer ids given for a ``reference_depth``-deep model, at the same relative depth in a
    ``num_layers``-deep one (sorted, distinct, in range)."""
    return tuple(sorted({min(round(layer * num_layers / reference_depth), num_layers - 1) for layer in layers}))
