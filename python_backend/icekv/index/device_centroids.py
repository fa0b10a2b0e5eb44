"""A copy of one layer's page centroids on the compute device, where the centroids search scores
them; the host then reads only the candidates' keys (:func:`icekv.index.fused_search.candidate_search`).

The host :class:`PageStore` stays the source of truth: :meth:`DeviceCentroids.refresh` copies the
rows whose version changed since the last refresh (an insert changes a handful of pages), or all
of them when the store grew. Scoring is :func:`icekv.kernels.select_pages` with each centroid as a
one-token page and each query head as its own row (a group of one): per query head, its best
``candidates`` pages by q.centroid, ties to the lower page id, as the host search picks them.
The copy is in the compute dtype: it only nominates candidates, which the host rescores exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from icekv.index.page_store import PageStore
from icekv.index.score_rows import decode
from icekv.kernels import select_pages


class DeviceCentroids:
    """One layer's page centroids (of ``store``) on ``device`` in ``dtype``."""

    def __init__(self, store: PageStore, device: torch.device, dtype: torch.dtype):
        self.store, self.device, self.dtype = store, device, dtype
        self.centroid = torch.zeros(0, device=device)  # [H, cap, 1, D] one-token pages
        self.live = torch.zeros(0, dtype=torch.int32, device=device)  # [H, cap] 1 on a page with members
        self.version = np.zeros((0, 0), dtype=np.int64)  # [H, cap] the store's versions at the last refresh
        self._ids = torch.zeros(0, dtype=torch.int32, device=device)  # [m] 0 .. m-1, the candidates' ids
        self.bytes_moved = 0  # rows copied to the device
        self.refresh()

    @property
    def nbytes(self) -> int:
        """Device memory of the copy."""
        return self.centroid.nbytes + self.live.nbytes + self._ids.nbytes

    @torch.inference_mode()  # the copy may be made inside the forward pass and refreshed outside it
    def refresh(self) -> None:
        """Copy the centroids of the pages that changed on the host (all of them after a growth)."""
        store, version = self.store, self.store.version.numpy()  # [H, cap]
        grown = version.shape != self.version.shape
        heads, pages = np.indices(version.shape).reshape(2, -1) if grown else np.nonzero(version != self.version)
        h, p = torch.from_numpy(heads), torch.from_numpy(pages)  # [n] each
        rows = decode(store.centroid[h, p]).to(self.dtype)  # [n, D] NaN on a page without members
        live = (store.tokens[h, p] >= 0).any(-1).to(torch.int32)  # [n]
        if grown:
            self.centroid = torch.zeros((*version.shape, 1, rows.shape[-1]), dtype=self.dtype, device=self.device)
            self.live = torch.zeros(version.shape, dtype=torch.int32, device=self.device)
        if len(h):
            h, p = h.to(self.device), p.to(self.device)
            self.centroid[h, p, 0] = rows.to(self.device)
            self.live[h, p] = live.to(self.device)
            self.bytes_moved += rows.nbytes + live.nbytes
        self.version = version.copy()

    def candidates(self, q: torch.Tensor, candidates: int) -> torch.Tensor:
        """q [H, G, D] on the device -> picks [H, G, c] int32 on the device: each query head's
        best ``c = min(candidates, pages)`` pages by q.centroid, best first, -1 past the pages
        with members."""
        m = int(self.store.num_pages.max()) if q.shape[0] else 0
        if len(self._ids) < m:
            self._ids = torch.arange(self.centroid.shape[1], dtype=torch.int32, device=self.device)
        return best_per_query_head(q, self.centroid, self._ids[:m], self.live[:, :m], min(candidates, m))[0]


def best_per_query_head(q: torch.Tensor, pages: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor,
                        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, G, D], pages [H, S, P, D], each KV head's candidates: slots ids [H, m] (or [m], the
    same for every head) and their valid tokens lens [H, m], int32 on the device -> (slots [H, G,
    k] int32, scores [H, G, k] fp32): each query head's best ``k`` candidates by max q.k over their
    tokens, best first (ties: the earlier candidate), -1 (and -inf) past those with tokens; ``k``
    at most m. ``select_pages`` with each query head a row of its own (batch G, group 1):
    grouped, it would rank by the GQA group's shared score."""
    heads, group, _ = q.shape
    m = ids.shape[-1]
    rows = q.transpose(0, 1).to(pages.dtype).contiguous()  # [G, H, D]
    ids, lens = (t.expand(group, heads, m).contiguous() for t in (ids, lens))  # [G, H, m] each
    best, _, scores = select_pages(rows, pages, ids, lens, k)  # [G, H, k], _, [G, H, m]
    return best.transpose(0, 1), scores.topk(k, dim=-1).values.transpose(0, 1)  # [H, G, k] each
