"""The pages of one layer's DCI trees (one per KV head), and the searches that read them.

Each DCI tree decides which tokens form its pages; the pages live here: their members (local
token ids), version, keys page-major (the index's only copy of them, as rows of the score dtype:
fp32, bf16 or int8 with a scale, see :mod:`icekv.index.score_rows`), a pad row (``-inf`` on a
hole) and the page's mean key. The heads of a layer share one set of ``[H, cap, ...]`` tensors,
so a search scores every head's pages with one batched product, and the transfer path looks up
every head's selected pages with one index, instead of one small call per head (per-call overhead
dominates at decode sizes on a CPU).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from icekv.index.score_rows import SCALE_BYTES, computable, decode, encode, narrow, raw, row_width, widen

NEG_INF = float("-inf")


class PageStore:
    """Members [H, cap, P], versions [H, cap], keys [H, cap, P, W], pads [H, cap, P] and centroids
    [H, cap, W] (W: a stored row's width, D unless int8) of the pages of ``heads`` trees. The trees
    write members and versions, and :meth:`rewrite` a page's keys, pad and centroid whenever its
    members change (:meth:`write` sets them from given keys: the plain-torch specification of a row)."""

    def __init__(self, heads: int, page_size: int, dim: int, dtype: torch.dtype = torch.float32):
        self.tokens = torch.full((heads, 0, page_size), -1, dtype=torch.long)  # [H, cap, P] -1: a hole
        self.version = torch.zeros(heads, 0, dtype=torch.long)  # [H, cap] bumped on every change
        w = row_width(dim, dtype)
        self.keys = torch.zeros(heads, 0, page_size, w, dtype=dtype)  # [H, cap, P, W] 0 on holes
        self.pad = torch.full((heads, 0, page_size), NEG_INF)  # [H, cap, P] 0 on a token, -inf on a hole
        self.centroid = torch.zeros(heads, 0, w, dtype=dtype)  # [H, cap, W] each page's mean key
        self.num_pages = torch.zeros(heads, dtype=torch.long)  # [H] pages in use per head
        self._search_views: tuple | None = None  # numpy views for the compiled search; None: stale

    @staticmethod
    def slot_bytes(dim: int, dtype: torch.dtype) -> int:
        """Bytes of one token slot of a page: its key row, pad and member id."""
        return row_width(dim, dtype) * dtype.itemsize + 4 + 8

    @staticmethod
    def page_bytes(dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page beyond its slots: its centroid row and version."""
        return row_width(dim, dtype) * dtype.itemsize + 8

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def dim(self) -> int:
        """Values per key (D)."""
        return self.centroid.shape[-1] - (SCALE_BYTES if self.keys.dtype == torch.int8 else 0)

    @property
    def nbytes(self) -> int:
        """Host memory of the store (allocated capacity, all heads)."""
        return sum(t.nbytes for t in (self.tokens, self.version, self.keys, self.pad, self.centroid, self.num_pages))

    def reserve(self, pages: int) -> None:
        """Make room for ``pages`` pages per head (callers ask with headroom: growing copies all)."""
        if pages <= self.capacity:
            return
        extra = pages - self.capacity
        h, _, p, d = self.keys.shape
        self.tokens = torch.cat([self.tokens, self.tokens.new_full((h, extra, p), -1)], 1)
        self.version = torch.cat([self.version, self.version.new_zeros(h, extra)], 1)
        self.keys = torch.cat([self.keys, self.keys.new_zeros(h, extra, p, d)], 1)
        self.pad = torch.cat([self.pad, self.pad.new_full((h, extra, p), NEG_INF)], 1)
        self.centroid = torch.cat([self.centroid, self.centroid.new_zeros(h, extra, d)], 1)
        self._search_views = None

    def search_views(self) -> tuple:
        """(centroid, keys, pad, num_pages, version) as numpy views (bf16 as bits) for the compiled
        search: built once per allocation, as the search runs every layer and step and each
        conversion costs microseconds there. The views share memory: they see every write."""
        if self._search_views is None:
            self._search_views = (raw(self.centroid), raw(self.keys), self.pad.numpy(), self.num_pages.numpy(),
                                  self.version.numpy())
        return self._search_views

    def positions(self, heads: np.ndarray, pages: np.ndarray, base: int) -> np.ndarray:
        """Members of page ``pages[i]`` of head ``heads[i]`` ([n] each) as positions (local id +
        ``base``), -1 on holes: [n, P]."""
        return _positions(self.tokens.numpy(), heads, pages, base)

    def write(self, head: int, pages: torch.Tensor, keys: torch.Tensor, present: torch.Tensor) -> None:
        """Set ``pages`` [m] of ``head``: keys [m, P, D] (any value on holes), present [m, P] bool."""
        keys = keys.float() * present[..., None]  # [m, P, D] 0 on holes
        self.keys[head, pages] = encode(keys, self.keys.dtype)
        self.pad[head, pages] = torch.where(present, 0.0, NEG_INF)
        self.centroid[head, pages] = encode(keys.sum(1) / present.sum(1, keepdim=True), self.centroid.dtype)  # [m, W]

    def rewrite(self, head: int, pages: torch.Tensor, loc: torch.Tensor, new_keys: torch.Tensor, first_new: int) -> None:
        """Rebuild the rows of ``pages`` [m] of ``head`` from their members (``tokens``), after a
        tree moved tokens between them: members from ``first_new`` on take their key from
        ``new_keys`` [*, D] (fp32), older ones from the row ``loc`` [n] names (token -> page * P +
        slot), which is then updated. One compiled pass (an insert changes a handful of pages)."""
        _rewrite(self.tokens[head].numpy(), loc.numpy(), raw(self.keys[head]), self.pad[head].numpy(),
                 raw(self.centroid[head]), pages.numpy(), new_keys.float().contiguous().numpy(), first_new)

    def _heads(self, head: int | None):
        """The arrays of every head, or of one (kept as a head axis of 1)."""
        pick = slice(None) if head is None else slice(head, head + 1)
        return self.keys[pick], self.pad[pick], self.centroid[pick], self.num_pages[pick]

    def exact_scores(self, q: torch.Tensor, head: int | None = None) -> torch.Tensor:
        """q [H, G, D] -> every page's best q.k [H, G, m] (m: the most pages of a head; ``-inf``
        past a head's own pages).

        ``head``: score only that head's pages (q [1, G, D])."""
        keys, pad, _, num_pages = self._heads(head)
        h, _, p, _ = keys.shape
        m = int(num_pages.max()) if h else 0
        keys = computable(keys[:, :m])  # [H, m, P, D]
        s = torch.bmm(keys.reshape(h, m * p, q.shape[-1]), q.transpose(1, 2).to(keys.dtype))  # [H, m*P, G]
        s = (s.float().view(h, m, p, q.shape[1]) + pad[:, :m, :, None]).amax(2)  # [H, m, G]
        return s.transpose(1, 2) + _unused(num_pages, m)

    def centroid_scores(self, q: torch.Tensor, candidates: int, head: int | None = None) -> torch.Tensor:
        """q [H, G, D] -> [H, G, m]: :meth:`centroid_candidates` laid out over every page, ``-inf``
        on the pages that were not candidates."""
        ids, cand = self.centroid_candidates(q, candidates, head)  # [H, c], [H, G, c]
        m = int(self._heads(head)[3].max()) if len(ids) else 0
        scores = torch.full((len(ids), q.shape[1], m + 1), NEG_INF)  # [H, G, m + 1] last: padding
        scores.scatter_(2, torch.where(ids >= 0, ids, m)[:, None, :].expand_as(cand), cand)
        return scores[..., :m]

    def centroid_candidates(self, q: torch.Tensor, candidates: int,
                            head: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [H, G, D] -> (ids [H, c], scores [H, G, c]): per KV head, the union of its query heads'
        best ``candidates`` pages by ``q.centroid`` (ids ascending, -1 padding) and their exact best
        q.k for every query head (``-inf`` on padding).

        Only the centroids and the candidates' keys are read. ``head``: that head only (q [1, G, D])."""
        keys, pad, centroid, num_pages = self._heads(head)
        h, cap, p, w = keys.shape
        g = q.shape[1]
        m = int(num_pages.max()) if h else 0
        if m == 0:
            return torch.full((h, 0), -1, dtype=torch.long), torch.full((h, g, 0), NEG_INF)
        # products in torch, the small index work in numpy (a tenth of torch's per-call cost)
        estimate = (torch.bmm(q.float(), decode(centroid[:, :m]).transpose(1, 2)) + _unused(num_pages, m)).numpy()  # [H, G, m]
        c = min(candidates, m)
        top = np.argpartition(estimate, m - c, axis=2)[..., m - c:]  # [H, G, c] unordered
        pick = np.zeros((h, m), dtype=bool)  # [H, m] the union over query heads
        pick[np.arange(h)[:, None], top.reshape(h, -1)] = True
        hs, pages = np.nonzero(pick & np.isfinite(estimate[:, 0]))  # [n], [n] grouped by head, pages ascending
        n = len(hs)
        flat = torch.from_numpy(hs * cap + pages)  # [n] rows of the [H * cap] views
        k = computable(keys.view(h * cap, p, w).index_select(0, flat))  # [n, P, D]
        # every query head against every candidate in one product (cheaper on a CPU than a bmm of
        # n tiny batches or one skinny product per head), then each candidate keeps its own head's
        s = (k.reshape(n * p, q.shape[-1]) @ q.reshape(h * g, -1).T.to(k.dtype)).float()  # [n * P, H * G]
        s = s.view(n, p, -1) + pad.view(h * cap, p).index_select(0, flat)[..., None]  # [n, P, H * G]
        s = s.amax(1).numpy().reshape(n, h, g)[np.arange(n), hs]  # [n, G]
        per_head = np.bincount(hs, minlength=h)  # [H]
        rank = np.arange(n) - (np.cumsum(per_head) - per_head)[hs]  # [n] place within its head
        ids = np.full((h, int(per_head.max())), -1, dtype=np.int64)  # [H, c]
        ids[hs, rank] = pages
        scores = np.full((h, g, ids.shape[1]), -np.inf, dtype=np.float32)  # [H, G, c]
        scores[hs, :, rank] = s
        return torch.from_numpy(ids), torch.from_numpy(scores)


def _unused(num_pages: torch.Tensor, m: int) -> torch.Tensor:
    """num_pages [H] -> [H, 1, m]: 0 on a page in use, -inf past a head's pages."""
    used = torch.arange(m)[None, :] < num_pages[:, None]  # [H, m]
    return torch.where(used, 0.0, NEG_INF)[:, None, :]


@numba.njit(cache=True, nogil=True)
def _rewrite(tokens, loc, keys, pad, centroid, pages, new_keys, first_new):
    """:meth:`PageStore.rewrite` on one head's rows: tokens [cap, P], loc [n], keys [cap, P, W],
    pad [cap, P], centroid [cap, W]; pages [m]; new_keys [n_new, D]."""
    m, page_size, d = pages.shape[0], pad.shape[1], new_keys.shape[1]
    flat = keys.reshape(-1, keys.shape[2])  # [cap * P, W] the rows loc names
    fresh = np.zeros((m, page_size, d), dtype=np.float32)  # [m, P, D] every old row read before any is written
    buf = np.empty(d, dtype=np.float32)
    for i in range(m):
        for s in range(page_size):
            t = tokens[pages[i], s]
            if t >= first_new:
                fresh[i, s] = new_keys[t - first_new]
            elif t >= 0:
                fresh[i, s] = widen(flat[loc[t]], buf)
    for i in range(m):
        page, count = pages[i], 0
        mean = np.zeros(d, dtype=np.float32)  # [D]
        for s in range(page_size):
            t = tokens[page, s]
            pad[page, s] = 0.0 if t >= 0 else -np.inf
            narrow(fresh[i, s], keys[page, s])  # zeros on a hole
            if t >= 0:
                loc[t] = page * page_size + s
                mean += fresh[i, s]
                count += 1
        narrow(mean / np.float32(count) if count else np.full(d, np.nan, dtype=np.float32), centroid[page])  # no members: NaN


@numba.njit(cache=True, nogil=True)
def _positions(tokens, heads, pages, base):
    """tokens [H, cap, P], heads [n], pages [n] -> [n, P] positions, -1 on holes."""
    out = np.empty((heads.shape[0], tokens.shape[2]), dtype=np.int64)
    for i in range(heads.shape[0]):
        for j in range(tokens.shape[2]):
            t = tokens[heads[i], pages[i], j]
            out[i, j] = t + base if t >= 0 else -1
    return out
