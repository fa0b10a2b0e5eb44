"""IceCache (a DCI-tree per layer and KV head) and IceCache(r) (one tree per group of layers): the
settings, the selector and the two registry entries.

The selector: per KV head, a DCI-tree clusters keys into pages; each step a search picks them.
``layer_reuse`` gives IceCache(r): layers form groups of ``layer_group``; only a group's first
layer has trees and runs the search, the others lay out their tokens in the same pages and reuse
its selection. IceCache can select over a compressed context only without layer reuse:
compression keeps different tokens in each layer, while IceCache(r) shares one token-to-page map
across a group of layers.

Where the centroids search scores the centroids is ``config.centroid_scoring``: on the compute
device (the query's), a copy of each layer's centroids is kept there, made at the layer's first
search and refreshed after each insert (:mod:`icekv.index.device_centroids`), and only the
candidates' ids come back; on the host, with the rest of the index. Where it rescores them is
``config.rescoring``: on the host from the index, or on the compute device from a cache of the
recent candidates' keys there (:mod:`icekv.index.device_rescoring`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from icekv.errors import ConfigError
from icekv.index import DCITree, PageStore
from icekv.index.device_centroids import DeviceCentroids
from icekv.index.device_rescoring import DeviceRescoring
from icekv.index.fused_search import candidate_search, centroid_search
from icekv.index.sizing import device_copy_bytes, tree_index_bytes
from icekv.methods.base import Policy
from icekv.methods.gqa import merge_ranked, merge_ranked_heads
from icekv.methods.selector import Selection

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan

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
      nodes per level.
    - ``exhaustive``: every page scored exactly (the walk with an unlimited field of view).
    - ``centroids``: every page ranked by ``q.centroid`` (one vector per page), each query head's
      best ``candidates(k)`` pages rescored exactly (the default: higher recall than the walk,
      measured by bench/selection_recall.py; docs/engine.md, "Why these defaults").

    ``candidates(k)`` is ``rerank * k`` pages, and at least ``min_candidates``. A page's centroid
    is the mean of its keys, and a needle is a few tokens of its page: its page can rank low by
    centroid while its best token scores high, so a small budget needs a large floor.

    ``score_dtype``: the dtype of the index's page keys (its only copy of them) and centroids.
    ``auto`` (the default, :meth:`page_keys`) follows the KV: bf16 keys under a bf16 or fp16 KV
    cache, fp32 under fp32, so the index never holds its keys wider than the KV it indexes. bf16
    keys halve the index memory and search bytes; the compiled walk and centroids searches widen
    them to fp32, the exhaustive search (torch) rounds q to bf16. ``int8`` stores each key as int8 values with its own
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
    """

    ratio_1: float = 0.02
    ratio_2: float = 0.2
    max_level: int = 4
    fov_min: int = 30
    fov_fraction: float = 1.5e-3
    layer_group: int = 3  # icecache_r: layers per group sharing one index
    seed: int = 0  # the random projection that orders a node's children
    search: str = "centroids"  # "centroids" | "walk" (the paper's tree walk) | "exhaustive" (every page exactly)
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

    def page_keys(self, dtype) -> str:
        """The page keys' dtype over a KV cache of ``dtype`` (a torch dtype or its name):
        ``score_dtype``, with ``auto`` bfloat16 for a bf16 or fp16 KV (fp16 keys have no format
        of their own: bf16's are as wide) and float32 for an fp32 one."""
        if self.score_dtype != "auto":
            return self.score_dtype
        return "bfloat16" if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") else "float32"

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


@dataclass
class IceCacheSelector:
    page_size: int = 16
    config: IceCacheConfig = field(default_factory=IceCacheConfig)
    layer_reuse: bool = False
    first_sparse_layer: int = 2
    trees: dict = field(init=False, default_factory=dict)  # leader layer -> [DCITree per KV head]
    stores: dict = field(init=False, default_factory=dict)  # leader layer -> the trees' PageStore
    base: dict = field(init=False, default_factory=dict)  # layer -> position of local token 0
    device_centroids: dict = field(init=False, default_factory=dict)  # leader layer -> DeviceCentroids
    device_rescoring: dict = field(init=False, default_factory=dict)  # leader layer -> DeviceRescoring
    _last: dict = field(init=False, default_factory=dict)  # leader layer -> its latest selection

    def leader(self, layer: int) -> int:
        """The layer whose trees serve ``layer``."""
        if not self.layer_reuse:
            return layer
        group = self.config.layer_group
        return self.first_sparse_layer + (layer - self.first_sparse_layer) // group * group

    def _projection(self, dim: int) -> torch.Tensor:
        u = torch.randn(dim + 1, generator=torch.Generator().manual_seed(self.config.seed))
        return u / u.norm()

    def build(self, layer, keys, base):
        self.base[layer] = base
        if self.leader(layer) != layer:
            return
        dim = keys[0].shape[-1]  # keys: [Hkv, n, D] or per-head [n_h, D]
        u = self._projection(dim)
        store = self.stores[layer] = PageStore(len(keys), self.page_size, dim, getattr(torch, self.config.page_keys(keys[0].dtype)))
        self.trees[layer] = [DCITree(k, self.page_size, self.config, u, store, h) for h, k in enumerate(keys)]

    def insert(self, layer, keys):
        if self.leader(layer) == layer:
            for tree, k in zip(self.trees[layer], keys):
                tree.insert(k)
            if layer in self.device_centroids:
                self.device_centroids[layer].refresh()

    def scores_on_device(self, device_type: str) -> bool:
        """Does the search score the query on the compute device (so it wants the query there)?"""
        return self.config.scores_centroids_on_device(device_type)

    def select(self, layer, q, k):
        lead = self.leader(layer)
        if lead != layer:
            return self._last[lead]
        q = q.view(len(self.trees[layer]), -1, q.shape[-1])  # [Hkv, G, D] on the compute device
        self._last[layer] = picks = self._search(layer, q, k)
        return picks

    def _search(self, layer: int, q: torch.Tensor, k: int) -> Selection:
        """q [Hkv, G, D] -> per KV head up to ``k`` pages, by ``config.search``."""
        store, search, candidates = self.stores[layer], self.config.search, self.config.candidates(k)
        by_score = self.config.merges_by_score
        if self.config.scores_centroids_on_device(q.device.type):  # candidates there
            if layer not in self.device_centroids:
                self.device_centroids[layer] = DeviceCentroids(store, q.device, q.dtype)
            picks = self.device_centroids[layer].candidates(q, candidates).cpu().numpy()  # [Hkv, G, c]
            if self.config.rescores_on_device():  # and their exact scores
                if layer not in self.device_rescoring:
                    slots = q.shape[1] * candidates  # the most a step's union can hold
                    self.device_rescoring[layer] = DeviceRescoring(store, q.device, q.dtype, slots)
                return Selection(*map(torch.from_numpy, self.device_rescoring[layer].search(q, picks, k, by_score=by_score)))
            return Selection(*map(torch.from_numpy, candidate_search(store, q.cpu(), picks, k, by_score=by_score)))
        q = q.cpu()  # the rest of the index is on the host
        if search == "centroids":  # compiled, one call per layer
            return Selection(*map(torch.from_numpy, centroid_search(store, q, candidates, k, by_score=by_score)))
        versions = store.version.numpy()  # [Hkv, cap]
        if search == "walk":  # one walk per head: each visits different nodes
            trees = self.trees[layer]
            fov = self.config.field_of_view(self.base[layer] + trees[0].n)
            return Selection.ranked([merge_ranked(tree.page_scores(qh, fov), k, by_score=by_score) for tree, qh in zip(trees, q)], versions)
        return Selection.ranked(merge_ranked_heads(store.exact_scores(q), k, by_score=by_score), versions)  # exhaustive

    def page_positions(self, layer, heads, pages):
        return torch.from_numpy(self.stores[self.leader(layer)].positions(heads.numpy(), pages.numpy(), self.base[layer]))

    def index_bytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values()) + sum(t.nbytes for ts in self.trees.values() for t in ts)

    def device_bytes(self) -> int:
        return sum(c.nbytes for c in self._device_copies())

    def bytes_to_device(self) -> int:
        return sum(c.bytes_moved for c in self._device_copies())

    def _device_copies(self) -> tuple:
        return (*self.device_centroids.values(), *self.device_rescoring.values())


def _trees(plan: PolicyPlan, args: ModelArgs, layer_reuse: bool) -> int:
    """Trees per KV head: one per sparse layer, or per group of them under layer reuse."""
    layers = len(plan.sparse_layers(args))
    return -(-layers // plan.selection.icecache.layer_group) if layer_reuse else layers


def _policy(name: str, layer_reuse: bool, **kinds) -> Policy:
    return Policy(
        name,
        selector=lambda plan: IceCacheSelector(plan.page_size, plan.selection.icecache, layer_reuse=layer_reuse,
                                               first_sparse_layer=plan.selection.n_unlimited_layers),
        index_bytes=lambda plan, args, tokens, dtype: tree_index_bytes(
            plan, args, tokens, dtype, _trees(plan, args, layer_reuse)),
        device_index_bytes=lambda plan, args, tokens, device_type, dtype_bytes: device_copy_bytes(
            plan, args, tokens, device_type, dtype_bytes, _trees(plan, args, layer_reuse)),
        extends_index=True, **kinds)


POLICY = _policy("icecache", layer_reuse=False, compressed_context=True)
POLICY_R = _policy("icecache_r", layer_reuse=True, consecutive_layers=True)
