"""IceCache: per KV head, a DCI-tree clusters keys into pages; each step a tree walk picks them.

``layer_reuse`` gives IceCache(r): layers form groups of ``layer_group``; only a group's first
layer has trees and runs the walk, the others lay out their tokens in the same pages and reuse its
selection.

Where the centroids search scores the centroids is ``config.centroid_scoring``: on the compute
device (the query's), a copy of each layer's centroids is kept there, made at the layer's first
search and refreshed after each insert (:mod:`icekv.index.device_centroids`), and only the
candidates' ids come back; on the host, with the rest of the index. Where it rescores them is
``config.rescoring``: on the host from the index, or on the compute device from a cache of the
recent candidates' keys there (:mod:`icekv.index.device_rescoring`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from icekv.config import IceCacheConfig
from icekv.index import DCITree, PageStore
from icekv.index.device_centroids import DeviceCentroids
from icekv.index.device_rescoring import DeviceRescoring
from icekv.index.fused_search import candidate_search, centroid_search
from icekv.select.base import Selection
from icekv.select.gqa import merge_ranked, merge_ranked_heads


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
