"""The DCI-tree of one (layer, KV head): IceCache's semantic page index.

Keys become points of a nearest-neighbour problem through the MIPS transform
``k -> [k, sqrt(M^2 - |k|^2)]`` (M^2: the running max squared norm), so the nearest transformed key
of a query ``[q/|q|, 0]`` is the key with the largest ``q.k``. Tokens are promoted to levels
deterministically in sequence order; each token's parent is its nearest neighbour among the next
non-empty level above. A node's children, ordered by a 1-D random projection, are cut into leaves
of at most ``page_size`` tokens: **a leaf is a page**, the unit that is selected, transferred and
attended. Every indexed token is in exactly one page.

Tokens are numbered locally ``0..n-1`` in insertion (= sequence) order. Node -> child pages is
kept in CSR form (``indptr`` over owners, root first), rebuilt lazily after insertions. A token's
key is kept once, in its page's row of the :class:`PageStore` (``loc`` says where); only the
promoted tokens, the ones a parent search compares against, also keep theirs in ``node_keys``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from icekv.index.page_store import PageStore
from icekv.index.levels import balanced_cut, promotion_levels, promotion_step, upper_step
from icekv.index.parents import ROOT, append_tokens
from icekv.index.placement import place_tokens
from icekv.index.score_rows import computable, raw
from icekv.index.tree_walk import walk_scores

if TYPE_CHECKING:  # a name only: the settings live with the method that uses the index
    from icekv.methods.icecache import IceCacheConfig

NEAREST_ROWS = 4096  # tokens per product when the build finds parents: bounds the [rows, nodes] scores


def with_headroom(n: int) -> int:
    """Capacity for ``n`` items that a long decode can grow into (1/8 more, at least 16): each
    growth copies everything, so it must be rare, but doubling would leave half the index's memory
    unused - and a server holds one index per request."""
    return n + max(16, n // 8)


def _extend(t: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``t`` grown along dim 0 to ``size`` rows (new rows ``fill``); unchanged if already as long."""
    if len(t) >= size:
        return t
    return torch.cat([t, torch.full((size - len(t), *t.shape[1:]), fill, dtype=t.dtype)])


def _max_last(x: np.ndarray) -> np.ndarray:
    """Max over a power-of-two last axis by halving: numpy reduces a short last axis slowly."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = np.maximum(x[..., :half], x[..., half:])
    return x[..., 0]


class DCITree:
    """Build once from the prefill keys, insert each flushed window page, query every step."""

    def __init__(self, keys: torch.Tensor, page_size: int, cfg: IceCacheConfig, projection: torch.Tensor,
                 store: PageStore | None = None, head: int = 0):
        """keys [n, D] in sequence order; projection [D + 1] a unit vector shared per request.

        The tree lives on the host; only the build's one bulk product (each token against the
        level above it, quadratic in n) runs where ``keys`` are: on a GPU when given there.
        ``store``: where the pages live, shared by a layer's trees (row ``head``); by default a
        store of this tree alone.
        """
        self.cfg, self.page_size = cfg, page_size
        self.store = store or PageStore(1, page_size, keys.shape[1], getattr(torch, cfg.page_keys(keys.dtype)))
        self.head = head
        self.u = projection.to(torch.float32)  # [D + 1]
        self.step = promotion_step(cfg)
        n, d = keys.shape
        on_device = keys.float()  # [n, D] for the parents' product
        keys = on_device.cpu()
        cap = with_headroom(n)
        self.n = n
        self.norm2 = torch.zeros(cap)  # [cap]
        self.proj = torch.zeros(cap)  # [cap]
        self.parent = torch.full((cap,), ROOT, dtype=torch.long)  # [cap]
        self.level = torch.zeros(cap, dtype=torch.long)  # [cap]
        self.loc = torch.full((cap,), -1, dtype=torch.long)  # [cap] token -> page * P + slot in the store
        self.node_keys = torch.zeros(cap // self.step + 1, d)  # [cap / step, D] keys of promoted tokens
        self.node_keys[: len(keys[:: self.step])] = keys[:: self.step]
        self.norm2[:n] = keys.pow(2).sum(-1)
        self.max_norm2 = float(self.norm2[:n].max()) if n else 0.0
        self.level[:n] = promotion_levels(torch.arange(n), cfg)
        self.proj[:n] = self._project(keys, self.norm2[:n])
        self._assign_parents(on_device)
        self._cut_pages(keys)

    # ---- geometry of the MIPS transform
    def _aug(self, norm2: torch.Tensor) -> torch.Tensor:
        return (self.max_norm2 - norm2).clamp_min(0).sqrt()

    def _project(self, keys: torch.Tensor, norm2: torch.Tensor) -> torch.Tensor:
        return keys @ self.u[:-1] + self._aug(norm2) * self.u[-1]  # [n]

    def _nearest(self, who: torch.Tensor, keys: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
        """For local tokens ``who`` [a] with keys [a, D] (on any device: the product runs there),
        their nearest neighbour (transformed space) among the promoted tokens ``among`` [b]."""
        device = keys.device
        nodes = self.node_keys[among // self.step].to(device)  # [b, D]
        aug_who, aug_among = self._aug(self.norm2[who]).to(device), self._aug(self.norm2[among]).to(device)  # [a], [b]
        best = torch.empty(len(who), dtype=torch.long)  # [a]
        for lo in range(0, len(who), NEAREST_ROWS):
            hi = lo + NEAREST_ROWS
            sim = keys[lo:hi] @ nodes.T  # [rows, b]
            sim += aug_who[lo:hi, None] * aug_among[None, :]
            best[lo:hi] = sim.max(-1).indices.cpu()  # the first best, as argmax, in half its time on a CPU
        return among[best]  # [a]

    # ---- build
    def _assign_parents(self, keys: torch.Tensor) -> None:
        """keys [n, D] on the device the products run on."""
        level = self.level[: self.n]
        present = torch.unique(level).tolist()  # ascending
        for below, above in zip(present[:-1], present[1:]):
            who = torch.nonzero(level == below).flatten()
            self.parent[who] = self._nearest(who, keys[who.to(keys.device)], torch.nonzero(level == above).flatten())

    def _cut_pages(self, keys: torch.Tensor) -> None:
        n, p = self.n, self.page_size
        owner = self.parent[:n]  # [n]
        order = torch.argsort(self.proj[:n], stable=True)
        order = order[torch.argsort(owner[order], stable=True)]  # by owner, then projection
        sorted_owner = owner[order]
        uniq, counts = torch.unique_consecutive(sorted_owner, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        group = torch.repeat_interleave(torch.arange(len(uniq)), counts)  # [n]
        rank = torch.arange(n) - starts[group]
        page_in_group, slot, pages_per_group = balanced_cut(rank, counts[group], p)
        group_pages = (counts + p - 1) // p  # [groups]
        page_base = torch.cumsum(group_pages, 0) - group_pages
        page = page_base[group] + page_in_group  # [n]
        num_pages = int(group_pages.sum())
        cap = with_headroom(num_pages)
        self.num_pages = num_pages
        self.store.reserve(cap)
        self.page_tokens[page, slot] = order
        self.page_len = torch.zeros(cap, dtype=torch.long)  # [cap]
        self.page_len[:num_pages] = (self.page_tokens[:num_pages] >= 0).sum(-1)
        self.page_owner = torch.full((cap,), ROOT, dtype=torch.long)  # [cap]
        self.page_owner[page] = sorted_owner
        self._sync_pages(torch.arange(num_pages), keys, 0)
        self._csr_dirty = True

    @property
    def nbytes(self) -> int:
        """Host memory of the tree's own arrays (allocated capacity; its pages are in the store)."""
        arrays = [self.norm2, self.proj, self.parent, self.level, self.loc, self.node_keys, self.page_len,
                  self.page_owner]
        arrays += [getattr(self, a) for a in ("_csr_pages", "_csr_owner", "_csr_indptr") if hasattr(self, a)]
        return sum(t.nbytes for t in arrays)

    # ---- the pages (this head's rows of the store)
    @property
    def page_tokens(self) -> torch.Tensor:
        return self.store.tokens[self.head]  # [cap, P] local token ids, -1 on holes

    @property
    def page_version(self) -> torch.Tensor:
        return self.store.version[self.head]  # [cap] bumped on every change

    @property
    def page_keys(self) -> torch.Tensor:
        return self.store.keys[self.head]  # [cap, P, W] rows of the score dtype, 0 on holes

    @property
    def page_pad(self) -> torch.Tensor:
        return self.store.pad[self.head]  # [cap, P] 0 on a token, -inf on a hole

    @property
    def page_centroid(self) -> torch.Tensor:
        return self.store.centroid[self.head]  # [cap, W] each page's mean key, a row of the score dtype

    def _sync_pages(self, pages: torch.Tensor, new_keys: torch.Tensor, first_new: int) -> None:
        """Rewrite the store rows of ``pages`` [m] after their members changed: tokens from
        ``first_new`` on take their key from ``new_keys`` [*, D], older ones from their old row."""
        self.store.rewrite(self.head, pages, self.loc, new_keys, first_new)
        self.store.num_pages[self.head] = self.num_pages

    # ---- CSR: owner -> pages
    def _csr(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._csr_dirty:
            owner_key = self.page_owner[: self.num_pages] + 1  # root -> 0
            self._csr_pages = torch.argsort(owner_key, stable=True)
            self._csr_owner = owner_key[self._csr_pages]  # owner key of each page, CSR order
            counts = torch.bincount(owner_key, minlength=self.n + 1)
            self._csr_indptr = torch.zeros(self.n + 2, dtype=torch.long)
            self._csr_indptr[1:] = torch.cumsum(counts, 0)
            self._csr_dirty = False
        return self._csr_indptr, self._csr_pages

    # ---- query
    def page_scores(self, q: torch.Tensor, field_of_view: int) -> torch.Tensor:
        """q [G, D] (one KV head's query heads) -> page scores [G, num_pages].

        Each query head walks the tree top-down: score the children pages of its best
        ``field_of_view`` nodes exactly, descend. A page's score is the best ``q.k`` among its
        tokens, ``-inf`` where the walk never visited it. Compiled (:mod:`icekv.index.tree_walk`);
        :meth:`page_scores_reference` is the same walk in numpy.
        """
        indptr, csr_pages = (t.numpy() for t in self._csr())
        scores = walk_scores(q.float().contiguous().numpy(), indptr, csr_pages, self.page_tokens.numpy(),
                             raw(self.page_keys), self.page_pad.numpy(), self.num_pages, field_of_view)
        return torch.from_numpy(scores)

    def page_scores_reference(self, q: torch.Tensor, field_of_view: int) -> torch.Tensor:
        """:meth:`page_scores` on numpy views of the tree (all query heads' walks batched; the
        specification the compiled walk is tested against). bf16 keys: q is rounded to bf16 too;
        int8 keys are decoded to fp32."""
        indptr, csr_pages = (t.numpy() for t in self._csr())
        csr_owner, page_tokens = self._csr_owner.numpy(), self.page_tokens.numpy()
        dtype = self.page_keys.dtype
        page_keys = raw(self.page_keys)
        page_pad = self.page_pad.numpy()
        g = q.shape[0]
        heads = np.arange(g)[:, None]
        scores = np.full((g, self.num_pages), -np.inf, dtype=np.float32)  # [G, num_pages]
        pages = csr_pages[indptr[0] : indptr[1]]  # [m] the root's pages
        owner_ok = np.ones((g, len(pages)), dtype=bool)  # [G, m] page reached by head g
        while len(pages):
            toks = page_tokens.take(pages, axis=0)  # [m, P]
            k = computable(torch.from_numpy(page_keys.take(pages, axis=0)).view(dtype))  # [m, P, D] bf16 came as int16
            q_t = q.T.to(k.dtype)  # [D, G]
            # the product in torch: numpy's BLAS threads would fight torch's for the same cores
            s = (k.reshape(-1, k.shape[-1]) @ q_t).float().numpy().T.reshape(g, len(pages), -1)  # [G, m, P]
            s += page_pad.take(pages, axis=0)  # -inf on holes
            s[~owner_ok] = -np.inf
            scores[:, pages] = _max_last(s)
            flat = s.reshape(g, -1)  # [G, m*P]
            fov = min(field_of_view, flat.shape[1])
            best = np.argpartition(flat, flat.shape[1] - fov, axis=1)[:, -fov:]  # [G, fov] unordered
            nodes = np.where(np.isfinite(flat[heads, best]), toks.reshape(-1)[best], -2)  # -2: not a node
            mine = np.zeros((g, self.n + 2), dtype=bool)  # [G, n + 2] over owner keys; last: ignored
            mine[heads, np.where(nodes >= ROOT, nodes + 1, self.n + 1)] = True
            reached = mine.take(csr_owner, axis=1)  # [G, num_pages] in CSR order
            pick = reached[0].copy()
            for row in reached[1:]:  # faster than any(0) for a handful of rows
                pick |= row
            pages, owner_ok = csr_pages[pick], reached[:, pick]  # [m'], [G, m']
        return torch.from_numpy(scores)

    def exact_page_scores(self, q: torch.Tensor) -> torch.Tensor:
        """q [G, D] -> every page's exact score [G, num_pages] (best ``q.k`` of its tokens): what
        the walk returns with an unlimited field of view, as one product over all keys."""
        return self.store.exact_scores(q[None], self.head)[0, :, : self.num_pages]

    def centroid_page_scores(self, q: torch.Tensor, candidates: int) -> torch.Tensor:
        """q [G, D] -> page scores [G, num_pages]: exact for each query head's best ``candidates``
        pages by ``q.centroid``, ``-inf`` elsewhere.

        A page is a semantic cluster, so its mean key stands for it: one [pages, D] product ranks
        every page while reading ``1/page_size`` of the keys, and only the candidates' keys are
        read to score them exactly. An estimate, not a bound (key boxes bound q.k but are loose in
        64 dimensions); recall against the exact top-k is measured in bench/selection_recall.py.
        """
        return self.store.centroid_scores(q[None], candidates, self.head)[0, :, : self.num_pages]

    # ---- dynamic insertion
    def insert(self, keys: torch.Tensor) -> set[int]:
        """Append tokens (keys [m, D], next in sequence order) without a rebuild.

        Tokens join a page (``page_size`` tokens) at a time, so one call of many pages builds
        the tree that a call per page would. Each piece: its norms, levels, projections and
        parents in one compiled call (:mod:`icekv.index.parents`), then its placement into pages
        (which may split a full page), token by token, compiled (:mod:`icekv.index.placement`),
        then the changed pages' rows. Returns the ids of the pages that changed (new tokens,
        splits, new pages).
        """
        keys = keys.float().contiguous()
        changed: set[int] = set()
        for start in range(0, keys.shape[0], self.page_size):
            changed |= self._insert_piece(keys[start:start + self.page_size])
        return changed

    def _insert_piece(self, keys: torch.Tensor) -> set[int]:
        """:meth:`insert` of at most a page of tokens (keys [m, D], fp32, contiguous)."""
        m = keys.shape[0]
        self._grow(m)
        first = self.n
        self.n += m
        parent = self.parent.numpy()
        self.max_norm2 = append_tokens(
            keys.numpy(), first, self.u.numpy(), self.max_norm2, self.norm2.numpy(), self.proj.numpy(),
            self.level.numpy(), parent, self.node_keys.numpy(), self.step, upper_step(self.cfg), self.cfg.max_level)
        self._csr_dirty = True
        changed, self.num_pages = place_tokens(
            np.arange(first, self.n), parent[first : self.n], self.proj.numpy(), self.page_tokens.numpy(),
            self.page_len.numpy(), self.page_owner.numpy(), self.page_version.numpy(), self.num_pages)
        self._sync_pages(torch.from_numpy(changed), keys, first)
        return set(changed.tolist())

    def _grow(self, m: int) -> None:
        """Make room for ``m`` more tokens and ``m`` more pages."""
        if self.n + m > len(self.level):
            cap = with_headroom(self.n + m)
            for name, fill in (("norm2", 0), ("proj", 0), ("parent", ROOT), ("level", 0), ("loc", -1)):
                setattr(self, name, _extend(getattr(self, name), cap, fill))
            self.node_keys = _extend(self.node_keys, cap // self.step + 1, 0.0)
        if self.num_pages + m > len(self.page_len):
            cap = with_headroom(self.num_pages + m)
            self.store.reserve(cap)
            self.page_len, self.page_owner = _extend(self.page_len, cap, 0), _extend(self.page_owner, cap, ROOT)
