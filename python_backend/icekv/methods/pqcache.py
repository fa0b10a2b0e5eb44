"""PQCache: keys product-quantized per layer and KV head; q.k estimated from the codes.

At build, each KV head's region keys (post-RoPE) are split into ``sub_vectors`` parts and each
part clustered by k-means (Lloyd, from distinct random rows, as the authors' sklearn call) into
``2**sub_bits`` centroids; a key is then its parts' centroid ids. Each step a query's part
products with every centroid form a lookup table, and a token's estimate is the sum of its
codes' entries. As in the authors' code, the estimates are softmaxed per query head and summed
over the heads of a KV group; each KV head takes its best tokens, plus the most recent indexed
tokens (``recent_ratio`` of the selection). Tokens flushed out of the window are coded with the
existing centroids (no re-clustering).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from icekv.errors import ConfigError
from icekv.methods.base import Policy
from icekv.methods.tokens import TokenPages, TokenSelection, top_tokens

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


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


def kmeans(x: torch.Tensor, clusters: int, iters: int, seed: int) -> torch.Tensor:
    """x [G, n, d] -> centroids [G, clusters, d] of each group (Lloyd). Fewer than ``clusters``
    rows: every row is a centroid (the rest repeat row 0), so codes are exact."""
    g, n, d = x.shape
    if n <= clusters:
        pad = (x[:, :1] if n else torch.zeros(g, 1, d, dtype=x.dtype)).expand(g, clusters - n, d)
        return torch.cat([x, pad], 1).clone()
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:clusters]  # shared by all groups
    centroids = x[:, rows].clone()  # [G, C, d]
    for _ in range(iters):
        codes = nearest(x, centroids)  # [G, n]
        sums = torch.zeros_like(centroids).scatter_add_(1, codes[..., None].expand(-1, -1, d), x)
        counts = torch.zeros(g, clusters, dtype=x.dtype).scatter_add_(1, codes, torch.ones_like(codes, dtype=x.dtype))
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled][:, None]  # an empty cluster keeps its centroid
    return centroids


def nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """x [G, n, d], centroids [G, C, d] -> the nearest centroid (L2) of each row [G, n]."""
    dist = (centroids * centroids).sum(-1)[:, None, :] - 2 * x @ centroids.transpose(1, 2)  # [G, n, C]
    return dist.argmin(-1)


def estimate(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], centroids [Hkv, M, C, D/M], codes [Hkv, n, M] -> estimated q.k [Hq, n]: per
    part, a table of q's products with the centroids, looked up by each token's code."""
    hkv, m, c, sub = centroids.shape
    qh = q.float().view(hkv, -1, m, sub)  # [Hkv, G, M, d]
    table = torch.einsum("hgmd,hmcd->hgmc", qh, centroids)  # [Hkv, G, M, C]
    idx = codes.long().permute(0, 2, 1)[:, None].expand(-1, qh.shape[1], -1, -1)  # [Hkv, G, M, n]
    return table.gather(3, idx).sum(2).reshape(q.shape[0], codes.shape[1])  # [Hq, n]


def estimate_reference(q: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """:func:`estimate` from the decoded keys: q . (each token's centroids, concatenated)."""
    hkv, m, c, sub = centroids.shape
    parts = [centroids[:, j][torch.arange(hkv)[:, None], codes[:, :, j].long()] for j in range(m)]  # M x [Hkv, n, d]
    keys = torch.cat(parts, -1)  # [Hkv, n, D]
    group = q.shape[0] // hkv
    return torch.einsum("hd,hnd->hn", q.float(), keys.repeat_interleave(group, 0))


@dataclass
class PQCacheSelector(TokenSelection):
    page_size: int = 16
    config: PQCacheConfig = field(default_factory=PQCacheConfig)
    tokens: TokenPages = field(init=False)
    base: dict = field(init=False, default_factory=dict)  # layer -> position of local token 0
    centroids: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, M, C, D/M]
    codes: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, n, M] uint8
    _few: dict = field(init=False, default_factory=dict)  # layer -> its keys while they fit the codebook whole

    def __post_init__(self) -> None:
        self.tokens = TokenPages(self.page_size)

    def _parts(self, keys: torch.Tensor) -> torch.Tensor:
        """[Hkv, n, D] -> [Hkv * M, n, D / M]: each KV head's keys cut into parts."""
        hkv, n, d = keys.shape
        m = self.config.sub_vectors
        if d % m:
            raise ValueError(f"pqcache sub_vectors ({m}) must divide the head dim ({d})")
        return keys.float().view(hkv, n, m, d // m).permute(0, 2, 1, 3).reshape(hkv * m, n, d // m)

    def _encode(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [Hkv, n, D] -> codes [Hkv, n, M] under the layer's centroids."""
        cents = self.centroids[layer]
        hkv, m = cents.shape[:2]
        codes = nearest(self._parts(keys), cents.reshape(hkv * m, *cents.shape[2:]))  # [Hkv*M, n]
        return codes.view(hkv, m, -1).permute(0, 2, 1).to(torch.uint8)

    def build(self, layer, keys, base):
        keys = keys.cpu()  # codebooks and codes are kept and scored on the host
        cfg, hkv = self.config, keys.shape[0]
        self.base[layer] = base
        cents = kmeans(self._parts(keys), cfg.centroids, cfg.kmeans_iters, cfg.seed)  # [Hkv*M, C, d]
        self.centroids[layer] = cents.view(hkv, cfg.sub_vectors, *cents.shape[1:])
        self.codes[layer] = self._encode(layer, keys)
        if keys.shape[1] < cfg.centroids:  # a short region: rebuilt exactly as pages join, until it fills the codebook
            self._few[layer] = keys

    def insert(self, layer, keys):
        keys = keys.cpu()
        while layer in self._few and keys.shape[1]:  # a page at a time, each rebuilding while the codebook is short
            few = self._few.pop(layer)
            self.build(layer, torch.cat([few, keys[:, : self.page_size].to(few.dtype)], 1), self.base[layer])
            keys = keys[:, self.page_size :]
        if keys.shape[1]:
            self.codes[layer] = torch.cat([self.codes[layer], self._encode(layer, keys)], 1)

    def select(self, layer, q, k):
        codes = self.codes[layer]
        hkv, n = codes.shape[:2]
        want = k * self.page_size
        recent = min(int(want * self.config.recent_ratio), n)
        est = estimate(q.cpu(), self.centroids[layer], codes) * q.shape[-1] ** -0.5  # [Hq, n]
        votes = est.softmax(-1).view(hkv, q.shape[0] // hkv, n).sum(1)  # [Hkv, n]
        votes[:, n - recent:] = float("-inf")  # the recent ones are taken anyway
        tail = np.arange(n - recent, n)
        base = self.base[layer]
        per_head = [base + np.concatenate([ids, tail]) for ids in top_tokens(votes, want - recent)]
        return self.tokens.select(layer, per_head)


    def index_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.centroids.values(), *self.codes.values()))


def _index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """A one-byte code per part per token, and fp32 codebooks, per budgeted layer and KV head."""
    pq = plan.selection.pqcache
    layers = len(plan.sparse_layers(args))
    return layers * args.num_kv_heads * (tokens * pq.sub_vectors + pq.centroids * args.head_dim * 4)


POLICY = Policy("pqcache", selector=lambda plan: PQCacheSelector(plan.page_size, plan.selection.pqcache),
                index_bytes=_index_bytes)
