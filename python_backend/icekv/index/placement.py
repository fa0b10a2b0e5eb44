"""Placing inserted tokens into a DCI tree's pages: a compiled loop (numba) and its numpy reference.

Each token goes to the page of its parent node whose projection range fits it best (a gap of 0
inside a range); a full page splits in two at the median projection, the upper half becoming a
new page of the same owner; an owner without pages gets one. Tokens are placed one after another
(a split changes where the next one goes), which is why this is a loop, compiled: in numpy each
token would pay the per-call overhead.

Both functions take the tree's arrays as numpy views and update them in place:
``page_tokens [cap, P]`` (-1 on holes, members first), ``page_len``, ``page_owner`` and
``page_version`` ``[cap]``; ``proj [n]`` is every token's projection. They return the pages that
changed (ascending) and the new page count; the caller guarantees room for ``len(tokens)`` pages.
"""

from __future__ import annotations

import numba
import numpy as np


def place_tokens_reference(tokens, owners, proj, page_tokens, page_len, page_owner, page_version, num_pages):
    """The placement in numpy, token by token (the specification the compiled loop is tested against)."""
    changed = set()
    size = page_tokens.shape[1]
    for t, owner in zip(tokens.tolist(), owners.tolist()):
        mine = np.flatnonzero(page_owner[:num_pages] == owner)
        if len(mine) == 0:
            page_tokens[num_pages, 0], page_len[num_pages], page_owner[num_pages] = t, 1, owner
            page_version[num_pages] += 1
            changed.add(num_pages)
            num_pages += 1
            continue
        toks = page_tokens[mine]  # [m, P]
        held = proj[np.maximum(toks, 0)]  # [m, P]
        lo = np.where(toks >= 0, held, np.inf).min(-1)
        hi = np.where(toks >= 0, held, -np.inf).max(-1)
        gap = np.maximum(np.maximum(lo - proj[t], proj[t] - hi), 0)  # 0 inside a page's range
        page = int(mine[gap.argmin()])
        page_version[page] += 1
        changed.add(page)
        if page_len[page] < size:
            page_tokens[page, page_len[page]] = t
            page_len[page] += 1
            continue
        members = np.append(page_tokens[page], t)  # [P + 1]
        members = members[np.argsort(proj[members], kind="stable")]
        keep = (len(members) + 1) // 2
        page_tokens[page] = -1
        page_tokens[page, :keep], page_len[page] = members[:keep], keep
        rest = members[keep:]
        page_tokens[num_pages, : len(rest)], page_len[num_pages], page_owner[num_pages] = rest, len(rest), owner
        page_version[num_pages] += 1
        changed.add(num_pages)
        num_pages += 1
    return np.array(sorted(changed), dtype=np.int64), num_pages


@numba.njit(cache=True, nogil=True)
def place_tokens(tokens, owners, proj, page_tokens, page_len, page_owner, page_version, num_pages):
    """:func:`place_tokens_reference`, compiled."""
    size = page_tokens.shape[1]
    changed = np.zeros(page_tokens.shape[0], dtype=np.bool_)
    for i in range(tokens.shape[0]):
        t, owner, pt = tokens[i], owners[i], proj[tokens[i]]
        page, best = -1, np.inf
        for j in range(num_pages):  # the owner's page whose range is nearest (first on ties)
            if page_owner[j] != owner:
                continue
            lo, hi = np.inf, -np.inf
            for s in range(page_len[j]):
                lo, hi = min(lo, proj[page_tokens[j, s]]), max(hi, proj[page_tokens[j, s]])
            gap = max(lo - pt, pt - hi, 0.0)
            if gap < best or page < 0:
                page, best = j, gap
        if page < 0:
            page_tokens[num_pages, 0], page_len[num_pages], page_owner[num_pages] = t, 1, owner
            page_version[num_pages] += 1
            changed[num_pages] = True
            num_pages += 1
            continue
        page_version[page] += 1
        changed[page] = True
        if page_len[page] < size:
            page_tokens[page, page_len[page]] = t
            page_len[page] += 1
            continue
        members = np.empty(size + 1, dtype=page_tokens.dtype)  # [P + 1]
        members[:size], members[size] = page_tokens[page], t
        members = members[np.argsort(proj[members], kind="mergesort")]
        keep = (size + 2) // 2
        page_tokens[page, :] = -1
        page_tokens[page, :keep], page_len[page] = members[:keep], keep
        page_tokens[num_pages, : size + 1 - keep] = members[keep:]
        page_len[num_pages], page_owner[num_pages] = size + 1 - keep, owner
        page_version[num_pages] += 1
        changed[num_pages] = True
        num_pages += 1
    return np.nonzero(changed)[0], num_pages
