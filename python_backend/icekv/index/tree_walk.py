"""IceCache's top-down tree walk, compiled (numba): :meth:`DCITree.page_scores` on a CPU.

Same walk as :meth:`DCITree.page_scores_reference` (numpy, the specification it is tested
against): each query head scores the root's pages exactly, keeps its best ``field_of_view``
tokens, descends into the pages those tokens own, and repeats until no pages are left. A page's
score is the best ``q.k`` among its tokens, ``-inf`` where the walk never went. The numpy walk is
many small steps per level (per-call overhead dominates); here each query head walks in one loop,
the heads in parallel.
"""

from __future__ import annotations

import numba
import numpy as np

from icekv.index.kth_largest import top_k_finite
from icekv.index.score_rows import dots


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, parallel=True)
def walk_scores(q, indptr, csr_pages, page_tokens, page_keys, page_pad, num_pages, field_of_view):
    """q [G, D] fp32; indptr [n + 2] over owner keys (root 0, token t -> t + 1) into csr_pages
    [num_pages]; page_tokens [cap, P], page_keys [cap, P, W] (rows of the score dtype), page_pad
    [cap, P] -> scores [G, num_pages]."""
    g_n, d = q.shape
    page_size = page_tokens.shape[1]
    scores = np.full((g_n, num_pages), -np.inf, dtype=np.float32)  # [G, num_pages]
    for g in numba.prange(g_n):
        qg = q[g : g + 1]  # [1, D]
        buf = np.empty(d, dtype=np.float32)  # [D]
        dot = np.empty(1, dtype=np.float32)  # [1]
        level = csr_pages[indptr[0] : indptr[1]].copy()  # [m] the root's pages
        below = np.empty(num_pages, dtype=np.int64)  # the next level's pages (each page once per walk)
        while level.shape[0]:
            flat = np.empty(level.shape[0] * page_size, dtype=np.float32)  # [m * P] every slot's q.k
            for i in range(level.shape[0]):
                page = level[i]
                for s in range(page_size):
                    flat[i * page_size + s] = -np.inf
                    if page_pad[page, s] == 0.0:
                        dots(qg, page_keys[page, s], buf, dot)
                        flat[i * page_size + s] = dot[0]
                        scores[g, page] = max(scores[g, page], dot[0])
            chosen = top_k_finite(flat, field_of_view)  # [m * P] the best tokens (holes are -inf)
            n_below = 0
            for j in range(flat.shape[0]):
                if chosen[j]:  # descend into the pages this token owns
                    owner = page_tokens[level[j // page_size], j % page_size] + 1
                    for c in range(indptr[owner], indptr[owner + 1]):
                        below[n_below] = csr_pages[c]
                        n_below += 1
            level = below[:n_below].copy()
    return scores
