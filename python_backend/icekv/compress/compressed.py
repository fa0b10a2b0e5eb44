"""A compressed context: per layer and KV head, only the kept tokens' K/V, packed in pages.

Heads keep different numbers of tokens (the global threshold gives per-layer, per-head budgets),
so each layer stores its pages packed head after head with a CSR ``head_indptr``; nothing of the
evicted tokens remains. Keys are post-RoPE; ``positions`` keeps each token's original position.
K and V are stored rows in the pool's ``kv_dtype`` (packed codes and scales when quantized, see
:mod:`icekv.kv.quant`): a context keeps, and a store holds, the smaller pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icekv.kv import PagedKVCache
from icekv.kv.quant import KVFormat


@dataclass
class CompressedLayer:
    k: torch.Tensor  # [n_pages, P, W] stored rows
    v: torch.Tensor  # [n_pages, P, W]
    page_len: torch.Tensor  # [n_pages] int32
    positions: torch.Tensor  # [n_pages, P] int32, -1 = empty slot
    head_indptr: torch.Tensor  # [Hkv + 1] int64: head h owns pages head_indptr[h]:head_indptr[h+1]

    def check(self, page_size: int, length: int) -> None:
        """ValueError naming the first way the layer does not hold together (shapes, dtypes, the
        CSR over its pages, lengths and positions): what a store entry is checked for before use."""
        n = self.page_len.shape[0] if self.page_len.dim() == 1 else -1
        if self.k.dim() != 3 or self.k.shape != self.v.shape or self.k.dtype != self.v.dtype:
            raise ValueError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must be alike [pages, P, W]")
        if n != self.k.shape[0] or self.k.shape[1] != page_size or self.page_len.dtype != torch.int32:
            raise ValueError(f"page_len must be int32 [{self.k.shape[0]}] and pages of {page_size} slots")
        if self.positions.shape != self.k.shape[:2] or self.positions.dtype != torch.int32:
            raise ValueError(f"positions must be int32 {tuple(self.k.shape[:2])}")
        ptr = self.head_indptr
        if ptr.dim() != 1 or len(ptr) < 2 or ptr.dtype != torch.int64:
            raise ValueError(f"head_indptr must be int64 [heads + 1], got {ptr.dtype} {tuple(ptr.shape)}")
        if ptr[0] != 0 or ptr[-1] != n or bool((ptr.diff() < 0).any()):
            raise ValueError(f"head_indptr must rise from 0 to the {n} pages")
        if bool(((self.page_len < 0) | (self.page_len > page_size)).any()):
            raise ValueError(f"a page length is outside 0..{page_size}")
        if bool(((self.positions < -1) | (self.positions >= length)).any()):
            raise ValueError(f"a position is outside -1..{length - 1}")

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages regrouped per head for attention: k, v [Hkv, K, P, W] stored rows, page_len [Hkv, K] (0 = pad)."""
        counts = self.head_indptr.diff()  # [Hkv]
        hkv, kmax = counts.numel(), int(counts.max()) if counts.numel() else 0
        slot = torch.arange(kmax)[None, :]  # [1, K]
        valid = slot < counts[:, None]  # [Hkv, K]
        index = (self.head_indptr[:-1, None] + slot).clamp_max(max(len(self.page_len) - 1, 0))  # [Hkv, K]
        if len(self.page_len) == 0:
            shape = (hkv, 0, *self.k.shape[1:])
            return self.k.new_zeros(shape), self.v.new_zeros(shape), torch.zeros(hkv, 0, dtype=torch.long)
        return self.k[index], self.v[index], torch.where(valid, self.page_len[index].long(), 0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.page_len, self.positions, self.head_indptr))

    @property
    def kept_per_head(self) -> list[int]:
        return [int(self.page_len[a:b].sum()) for a, b in zip(self.head_indptr[:-1], self.head_indptr[1:])]


@dataclass
class CompressedContext:
    """What a context store holds: the compressed KV of one context, plus how it was made."""

    length: int  # tokens of the original context: the question starts at this position
    page_size: int
    layers: list[CompressedLayer]
    method: str
    kv_budget: float
    full_bytes: int  # bytes the uncompressed KV of this context would take
    kv_dtype: str = "auto"  # how its rows are stored (:class:`icekv.kv.quant.KVFormat`)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(self.kv_dtype)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V pages only (what attention reads)."""
        return sum(2 * l.k.numel() * l.k.element_size() for l in self.layers)

    @classmethod
    def from_cache(cls, cache: PagedKVCache, seq_id: int, keep: torch.Tensor, method: str,
                   kv_budget: float) -> "CompressedContext":
        """Copy the kept tokens (keep [L, Hkv, T] bool) of a prefilled request into packed pages."""
        n_layers, hkv, length = keep.shape
        p = cache.page_size
        layers = []
        for layer in range(n_layers):
            k_all, v_all = cache.gather_rows(layer, seq_id, 0, length).cpu()  # [Hkv, T, W] stored rows, on the host
            ks, vs, lens, poss, counts = [], [], [], [], []
            for h in range(hkv):
                pos = torch.nonzero(keep[layer, h]).flatten()  # [n_h] ascending
                n_pages = -(-len(pos) // p)
                padded = torch.full((n_pages * p,), -1, dtype=torch.long)
                padded[: len(pos)] = pos
                page_pos = padded.view(n_pages, p)  # [n_pages, P]
                ks.append(k_all[h][page_pos.clamp_min(0)] * (page_pos >= 0)[..., None])
                vs.append(v_all[h][page_pos.clamp_min(0)] * (page_pos >= 0)[..., None])
                lens.append((page_pos >= 0).sum(-1))
                poss.append(page_pos)
                counts.append(n_pages)
            d = k_all.shape[-1]
            cat = lambda xs, shape: torch.cat(xs) if xs else torch.zeros(shape)
            layers.append(CompressedLayer(
                k=cat(ks, (0, p, d)).to(cache.pool.dtype).contiguous(),
                v=cat(vs, (0, p, d)).to(cache.pool.dtype).contiguous(),
                page_len=cat(lens, (0,)).to(torch.int32),
                positions=cat(poss, (0, p)).to(torch.int32),
                head_indptr=torch.tensor([0] + counts).cumsum(0),
            ))
        full = length * cache.bytes_per_token
        return cls(length, p, layers, method, kv_budget, full, cache.kv_format.name)
