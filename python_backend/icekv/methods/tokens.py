"""Token-level selections carried as pages, for the methods that pick tokens rather than pages.

PQCache, SnapKV, OmniKV and MagicPIG choose single tokens of the indexed region. The decode path
moves and attends pages of ``page_size`` slots, so each step a KV head's chosen tokens, in
sequence order, are cut into *virtual pages* (the last one partial, padded with -1), named by a
hash of the positions they hold: a device slot is reused when the same tokens form a page again,
and reloaded otherwise. As every page of a policy, a reloaded virtual page moves (and counts) a
whole page's bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from icekv.methods.selector import Selection


def top_tokens(scores: torch.Tensor, n: int) -> list[np.ndarray]:
    """scores [Hkv, T] (``-inf``: never chosen, ``inf``: always) -> per KV head the local ids of
    its ``n`` best tokens (fewer where fewer can be), in sequence order."""
    hkv, t = scores.shape
    n = min(n, t)
    if n == 0:
        return [np.zeros(0, np.int64) for _ in range(hkv)]
    s = scores.float().numpy()
    top = np.argpartition(s, t - n, axis=1)[:, t - n:]  # [Hkv, n] the best, unordered
    return [np.sort(ids[row[ids] > -np.inf]).astype(np.int64) for ids, row in zip(top, s)]


class TokenSelection:
    """What the token-level selectors share: their virtual pages (``self.tokens``) give the
    positions, and nothing of theirs is kept on or copied to the compute device."""

    tokens: TokenPages

    def page_positions(self, layer, heads, pages):
        return self.tokens.positions(layer, heads, pages)

    def device_bytes(self) -> int:
        return 0

    def bytes_to_device(self) -> int:
        return 0


class TokenPages:
    """Per layer, the current step's virtual pages of each KV head. A virtual page's id and
    version are both the hash of its positions, so a slot already holding the same tokens is
    reused wherever that page falls in this step's list."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._table: dict[int, tuple[np.ndarray, torch.Tensor]] = {}  # layer -> (sorted ids, positions [n, P])

    def select(self, layer: int, per_head: list[np.ndarray]) -> Selection:
        """Per KV head its chosen token positions [n_h] (sequence order) -> this step's selection."""
        p = self.page_size
        counts = np.array([-(-len(x) // p) for x in per_head], np.int64)  # [Hkv] pages per head
        table = np.full((int(counts.sum()), p), -1, np.int64)  # [n, P]
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)  # [Hkv]
        for h, positions in enumerate(per_head):
            table[first[h]: first[h] + counts[h]].reshape(-1)[: len(positions)] = positions
        ids = _row_hashes(table)  # [n]
        order = np.argsort(ids, kind="stable")
        self._table[layer] = (ids[order], torch.from_numpy(table[order]))
        heads = torch.from_numpy(np.repeat(np.arange(len(per_head)), counts))  # [n]
        return Selection(heads, torch.from_numpy(ids), torch.from_numpy(ids))

    def positions(self, layer: int, heads: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Virtual page ``pages[i]`` (its id) this step -> its positions [m, P] (the same for any head)."""
        ids, table = self._table[layer]
        return table[torch.from_numpy(np.searchsorted(ids, pages.numpy()))]


def _row_hashes(table: np.ndarray) -> np.ndarray:
    """A 63-bit hash of each row of positions [n, P] (a virtual page's version)."""
    if not len(table):
        return np.zeros(0, np.int64)
    mult = np.uint64(0x9E3779B97F4A7C15)
    h = np.full(len(table), 0xCBF29CE484222325, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for col in table.T.astype(np.uint64):
            h = (h ^ col) * mult
    return (h >> np.uint64(1)).astype(np.int64)
