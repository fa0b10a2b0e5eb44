"""One request's page index over vLLM's paged KV cache, and its decode attention: sink + the
selected pages + window, per KV head.

vLLM's CPU cache is the page pool: per layer ``[num_blocks, Hkv, block_size, 2 * D]``, each block
holding, per KV head, its K rows then its V rows, each packed as vLLM's kernel reads them
(:class:`BlockLayout`); a request's ``block_table`` row maps its token ``t`` to block
``block_table[t // block_size]``, row ``t % block_size``. The index is icekv's own
selector (any method whose selector sees only the keys), fed from those rows: built over the
region between sink and window at the request's first selecting decode of each layer, extended by
the pages that left the window, as :class:`icekv.engine.backends.SparseAttention` does over
icekv's own pool; or continued from a released request's index over the same first tokens. Nothing
here imports vLLM: the plugin hands it tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from icekv.kernels.cpu_decode import block_rows_decode_cpu
from icekv.policies import PolicyPlan
from icekv.policies.index_cache import KeptIndex


@dataclass(frozen=True)
class BlockLayout:
    """Where token ``t``'s dim ``j`` sits in one (block, KV head) tile of vLLM's CPU cache: its K at
    ``keys[t, j]``, its V at ``values[t, j]`` (flat offsets into the tile's ``2 * block_size * D``
    values; vLLM packs them for its kernel's ISA, e.g. K dim-major in fp32, pairs of rows in bf16)."""

    keys: torch.Tensor  # [bs, D] long
    values: torch.Tensor  # [bs, D] long

    @classmethod
    def plain(cls, block_size: int, head_dim: int) -> BlockLayout:
        """Each row's K then each row's V in order (the layout tests write)."""
        rows = torch.arange(block_size * head_dim).view(block_size, head_dim)  # [bs, D]
        return cls(rows, rows + block_size * head_dim)


class BlockRows:
    """One request's K and V rows in one layer of vLLM's CPU cache."""

    def __init__(self, kv_cache: torch.Tensor, block_table: torch.Tensor, layout: BlockLayout):
        blocks, kv_heads, block_size, width = kv_cache.shape  # [nb, Hkv, bs, 2D]
        self.tiles = kv_cache.view(blocks, kv_heads, block_size * width)  # [nb, Hkv, 2 * bs * D]
        self.block_table, self.block_size, self.kv_heads, self.layout = block_table.long(), block_size, kv_heads, layout

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [Hkv, n] (each KV head its own) -> its K and V rows [Hkv, n, D] each."""
        blocks = self.block_table[positions // self.block_size][..., None]  # [Hkv, n, 1]
        heads = torch.arange(self.kv_heads)[:, None, None]  # [Hkv, 1, 1]
        rows = positions % self.block_size  # [Hkv, n]
        keys = self.tiles[blocks, heads, self.layout.keys[rows]]  # [Hkv, n, D]
        return keys, self.tiles[blocks, heads, self.layout.values[rows]]

    def key_range(self, start: int, end: int) -> torch.Tensor:
        """Every KV head's keys of positions [start, end): [Hkv, end - start, D]. Whole blocks are
        read through the block table, then their key offsets (one index for every block and head),
        where :meth:`gather` indexes every value of every row."""
        first, last = start // self.block_size, -(-end // self.block_size)
        tiles = self.tiles.index_select(0, self.block_table[first:last])  # [nb, Hkv, 2 * bs * D]
        keys = tiles[:, :, self.layout.keys.flatten()]  # [nb, Hkv, bs * D] (index_select on this dim is slower)
        head_dim = self.layout.keys.shape[1]
        keys = keys.view(last - first, self.kv_heads, self.block_size, head_dim).transpose(0, 1)  # [Hkv, nb, bs, D]
        offset = first * self.block_size
        return keys.reshape(self.kv_heads, -1, head_dim)[:, start - offset:end - offset]


class RequestIndex:
    """A request's selector under its plan, and where each layer's window starts.

    A released request's index may be continued by a request whose tokens start with the ones it
    covers (:meth:`covered`; kept in :class:`icekv.policies.index_cache.IndexCache`): every layer's
    region then starts out indexed up to there, and only the pages past it are inserted."""

    def __init__(self, plan: PolicyPlan, continued: KeptIndex | None = None):
        self.plan = plan
        self.selector = plan.make_selector() if continued is None else continued.selector
        self.continued_from = 0 if continued is None else continued.covered  # every layer indexed up to here
        self.window_start: dict[int, int] = {}  # layer -> first position of its window
        self.steps = 0  # selecting decode steps, all layers (observable by tests and stats)

    def covered(self, budgeted_layers: int) -> int | None:
        """Where the indexed region ends in every one of the plan's ``budgeted_layers``; None where
        they differ (a step cut short) or one was never indexed. A continued index that no layer
        has attended with yet still covers what it was taken over with."""
        if not self.window_start and self.continued_from:
            return self.continued_from
        starts = set(self.window_start.values())
        return starts.pop() if len(self.window_start) == budgeted_layers and len(starts) == 1 else None

    def attend(self, layer: int, q: torch.Tensor, rows: BlockRows, length: int, scale: float) -> torch.Tensor:
        """q [Hq, D] of the newest of ``length`` tokens (its K and V already in the cache) ->
        attention over the sink, the selected pages and the window [Hq, D]."""
        plan, sink_end = self.plan, self.plan.sink_tokens
        target = plan.window_start(sink_end, length)
        if layer not in self.window_start and self.continued_from:
            self.window_start[layer] = self.continued_from
        elif layer not in self.window_start:
            self.selector.build(layer, rows.key_range(sink_end, target), sink_end)
            self.window_start[layer] = target
        if self.window_start[layer] < target:  # pages that left the window join the index, in one call
            self.selector.insert(layer, rows.key_range(self.window_start[layer], target))
            self.window_start[layer] = target
        selection = self.selector.select(layer, q.float(), plan.selected_pages)
        picked = self.selector.page_positions(layer, selection.heads, selection.pages)  # [n, P], -1: empty
        self.steps += 1
        return self._attend(q, rows, selection.heads, picked, sink_end, self.window_start[layer], length, scale)

    @staticmethod
    def _attend(q, rows: BlockRows, heads, picked, sink_end: int, window_start: int, length: int, scale: float):
        """Each KV head's sink + picked + window tokens, attended by its query heads."""
        ranges = np.array([[0, sink_end], [window_start, length]], dtype=np.int64)  # [2, 2]
        if q.dtype in COMPILED and rows.tiles.dtype in COMPILED:
            return block_rows_decode_cpu(q, rows.tiles, rows.block_table, rows.layout.keys, rows.layout.values, ranges,
                                         heads, picked, scale)
        return attend_reference(q, rows, ranges, heads, picked, scale)


COMPILED = (torch.float32, torch.bfloat16)  # the dtypes of queries and cache the compiled decode reads


def attend_reference(q: torch.Tensor, rows: BlockRows, ranges: np.ndarray, heads: torch.Tensor, picked: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [Hq, D] over each KV head's positions in ``ranges`` [R, 2] and in its picked pages
    (``picked[i]`` [n, P] where ``heads[i]`` is the head, -1: empty), in plain torch: what
    :func:`icekv.kernels.cpu_decode.block_rows_decode_cpu` computes in one call."""
    kv_heads = rows.kv_heads
    fixed = torch.cat([torch.arange(int(start), int(end)) for start, end in ranges])  # [f]
    per_head = [torch.cat([fixed, picked[heads == h].flatten()]) for h in range(kv_heads)]
    per_head = [p[p >= 0] for p in per_head]  # without the empty slots
    most = max(len(p) for p in per_head)
    positions = torch.stack([torch.nn.functional.pad(p, (0, most - len(p))) for p in per_head])  # [Hkv, n]
    valid = torch.arange(most)[None, :] < torch.tensor([len(p) for p in per_head])[:, None]  # [Hkv, n]
    keys, values = rows.gather(positions)  # [Hkv, n, D] each
    group = q.shape[0] // kv_heads
    qh = q.float().view(kv_heads, group, -1)  # [Hkv, G, D]
    scores = torch.einsum("hgd,hnd->hgn", qh, keys.float()) * scale  # [Hkv, G, n]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("hgn,hnd->hgd", scores.softmax(-1), values.float())  # [Hkv, G, D]
    return out.reshape(q.shape).to(q.dtype)
