"""The per-token bookkeeping of a DCI-tree insertion, in one compiled pass.

A decode step flushes one window page (16 tokens) into every sparse layer's trees. In torch the
norms, levels, projections and nearest-parent searches of those few tokens are some thirty small
calls per tree, each costing more in dispatch than in arithmetic; here they are one call. Same rules as the tree's build
(:func:`icekv.index.levels.promotion_levels`, ``DCITree._nearest``), tested against them.
"""

from __future__ import annotations

import numba
import numpy as np

ROOT = -1


@numba.njit(cache=True, nogil=True)
def token_level(j, step1, step2, max_level):
    """Level of local token ``j``: :func:`icekv.index.levels.promotion_levels` for one token."""
    level = 0
    promoted = j % step1 == 0
    q = j // step1
    power = 1
    for _ in range(max_level):
        level += promoted
        power *= step2
        promoted = promoted and q % power == 0
    return level


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def append_tokens(keys, first, u, max_norm2, norm2, proj, level, parent, node_keys, step1, step2, max_level):
    """Tokens ``first..first+m-1`` with keys [m, D] (fp32) join the tree's arrays (norm2, proj,
    level, parent [cap]; node_keys [cap / step1 + 1, D]; u [D + 1] the projection). Returns the
    new max squared norm.

    Each token's parent is its nearest neighbour in the MIPS-transformed space among the tokens
    of the lowest non-empty level above its own (ties: the lowest id), ``ROOT`` at the top."""
    m, d = keys.shape
    n = first + m
    top = max_norm2
    for i in range(m):
        s = np.float32(0.0)
        for t in range(d):
            s += keys[i, t] * keys[i, t]
        norm2[first + i] = s
        top = max(top, np.float64(s))
    top32 = np.float32(top)
    for i in range(m):
        j = first + i
        level[j] = token_level(j, step1, step2, max_level)
        s = np.float32(0.0)
        for t in range(d):
            s += keys[i, t] * u[t]
        proj[j] = s + np.sqrt(max(top32 - norm2[j], np.float32(0.0))) * u[d]
        if j % step1 == 0:
            node_keys[j // step1] = keys[i]
    present = np.zeros(max_level + 1, dtype=np.bool_)  # [levels] only promoted tokens sit above 0
    for j in range(0, n, step1):
        present[level[j]] = True
    for i in range(m):
        j = first + i
        target = level[j] + 1
        while target <= max_level and not present[target]:
            target += 1
        if target > max_level:
            parent[j] = ROOT
            continue
        aug = np.sqrt(max(top32 - norm2[j], np.float32(0.0)))
        best, best_sim = ROOT, -np.inf
        for a in range(0, n, step1):
            if level[a] != target:
                continue
            s = np.float32(0.0)
            for t in range(d):
                s += keys[i, t] * node_keys[a // step1, t]
            s += aug * np.sqrt(max(top32 - norm2[a], np.float32(0.0)))
            if s > best_sim:
                best, best_sim = a, s
        parent[j] = best
    return top
