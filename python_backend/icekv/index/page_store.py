"""The pages of one layer's DCI trees (one per KV head), and the searches that read them.

Each DCI tree decides which tokens form its pages; the pages live here: their members (local
token ids) and version, and a scoring copy of their keys page-major, with a pad row (``-inf`` on
a hole) and the page's mean key. The heads of a layer share one set of ``[H, cap, ...]`` tensors,
so a search scores every head's pages with one batched product, and the transfer path looks up
every head's selected pages with one index, instead of one small call per head (per-call overhead
dominates at decode sizes on a CPU).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


class PageStore:
    """Members [H, cap, P], versions [H, cap], keys [H, cap, P, D], pads [H, cap, P] and centroids
    [H, cap, D] of the pages of ``heads`` trees. The trees write members and versions; the scoring
    copy is refreshed with :meth:`write`."""

    def __init__(self, heads: int, page_size: int, dim: int, dtype: torch.dtype = torch.float32):
        self.tokens = torch.full((heads, 0, page_size), -1, dtype=torch.long)  # [H, cap, P] -1: a hole
        self.version = torch.zeros(heads, 0, dtype=torch.long)  # [H, cap] bumped on every change
        self.keys = torch.zeros(heads, 0, page_size, dim, dtype=dtype)  # [H, cap, P, D] 0 on holes
        self.pad = torch.full((heads, 0, page_size), NEG_INF)  # [H, cap, P] 0 on a token, -inf on a hole
        self.centroid = torch.zeros(heads, 0, dim)  # [H, cap, D] each page's mean key
        self.num_pages = torch.zeros(heads, dtype=torch.long)  # [H] pages in use per head

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def reserve(self, pages: int) -> None:
        """Make room for ``pages`` pages per head (capacity at least doubles when it grows)."""
        if pages <= self.capacity:
            return
        extra = max(pages, 2 * self.capacity, 64) - self.capacity
        h, _, p, d = self.keys.shape
        self.tokens = torch.cat([self.tokens, self.tokens.new_full((h, extra, p), -1)], 1)
        self.version = torch.cat([self.version, self.version.new_zeros(h, extra)], 1)
        self.keys = torch.cat([self.keys, self.keys.new_zeros(h, extra, p, d)], 1)
        self.pad = torch.cat([self.pad, self.pad.new_full((h, extra, p), NEG_INF)], 1)
        self.centroid = torch.cat([self.centroid, self.centroid.new_zeros(h, extra, d)], 1)

    def write(self, head: int, pages: torch.Tensor, keys: torch.Tensor, present: torch.Tensor) -> None:
        """Set ``pages`` [m] of ``head``: keys [m, P, D] (any value on holes), present [m, P] bool."""
        keys = keys * present[..., None]  # [m, P, D] 0 on holes
        self.keys[head, pages] = keys.to(self.keys.dtype)
        self.pad[head, pages] = torch.where(present, 0.0, NEG_INF)
        self.centroid[head, pages] = keys.float().sum(1) / present.sum(1, keepdim=True)  # [m, D]

    def _heads(self, head: int | None):
        """The arrays of every head, or of one (kept as a head axis of 1)."""
        pick = slice(None) if head is None else slice(head, head + 1)
        return self.keys[pick], self.pad[pick], self.centroid[pick], self.num_pages[pick]

    def exact_scores(self, q: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """q [H, G, D] -> every page's best q.k [H, G, m] (m: the most pages of a head; ``-inf``
        past a head's own pages).

        ``head``: score only that head's pages (q [1, G, D])."""
        keys, pad, _, num_pages = self._heads(head)
        h, _, p, d = keys.shape
        m = int(num_pages.max()) if h else 0
        s = torch.bmm(keys[:, :m].view(h, m * p, d), q.transpose(1, 2).to(keys.dtype))  # [H, m*P, G]
        s = (s.float().view(h, m, p, q.shape[1]) + pad[:, :m, :, None]).amax(2)  # [H, m, G]
        return s.transpose(1, 2) + _unused(num_pages, m)

    def centroid_scores(self, q: torch.Tensor, candidates: int, head: int | None = None) -> torch.Tensor:
        """q [H, G, D] -> [H, G, m]: each query head's best ``candidates`` pages by ``q.centroid``
        get their exact best q.k (for every query head of their KV head), the rest ``-inf``.

        Only the centroids and the candidates' keys are read. ``head``: that head only (q [1, G, D])."""
        keys, pad, centroid, num_pages = self._heads(head)
        h, cap, p, d = keys.shape
        m = int(num_pages.max()) if h else 0
        scores = torch.full((h, q.shape[1], m), NEG_INF)  # [H, G, m]
        if m == 0:
            return scores
        estimate = torch.bmm(q.float(), centroid[:, :m].transpose(1, 2)) + _unused(num_pages, m)  # [H, G, m]
        top = estimate.topk(min(candidates, m), dim=-1).indices  # [H, G, c]
        pick = torch.zeros(h, m, dtype=torch.bool)  # [H, m] the union over query heads
        pick.scatter_(1, top.reshape(h, -1), True)
        pick &= torch.isfinite(estimate[:, 0])  # never a page past num_pages
        hs, pages = pick.nonzero(as_tuple=True)  # [n], [n] grouped by head
        flat = hs * cap + pages  # [n] rows of the [H * cap] views
        k = keys.view(h * cap, p, d).index_select(0, flat)  # [n, P, D]
        # every query head against every candidate in one product (cheaper on a CPU than a bmm of
        # n tiny batches or one skinny product per head), then each candidate keeps its own head's
        s = (k.view(-1, d) @ q.reshape(-1, d).T.to(k.dtype)).float().view(len(flat), p, -1)  # [n, P, H * G]
        s = (s + pad.view(h * cap, p).index_select(0, flat)[..., None]).amax(1)  # [n, H * G]
        scores[hs, :, pages] = s.view(len(flat), h, -1)[torch.arange(len(flat)), hs]  # [n, G]
        return scores


def _unused(num_pages: torch.Tensor, m: int) -> torch.Tensor:
    """num_pages [H] -> [H, 1, m]: 0 on a page in use, -inf past a head's pages."""
    used = torch.arange(m)[None, :] < num_pages[:, None]  # [H, m]
    return torch.where(used, 0.0, NEG_INF)[:, None, :]
