"""Settings of the baseline decode policies, with their authors' defaults.

Each method keeps what is its own here (PQ codebooks, LSH tables, filter layers, the observation
window). What every sparse policy shares (page size, budget, sink and window pages) is
:class:`icekv.config.SelectionConfig`'s, so all policies are compared at the same budget. Where
an author's run differs from the shared region (ArkVale's 32-token pages, MagicPIG's 4 sink and 64
local tokens), icekv keeps the shared one; docs/baselines.md lists those differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from icekv.errors import ConfigError


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
