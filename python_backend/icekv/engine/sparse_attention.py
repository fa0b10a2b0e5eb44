"""The attention backend for budgeted decoding: sink + selected pages + window, per KV head.

The request's paged pool (:class:`PagedKVCache`) is the host page pool: it owns every token of
every layer. Per layer and KV head, the tokens between the sink pages and the window pages are the
*indexed region*; a selector groups them into pages and picks ``k`` per step, and only those move
into the layer's :class:`DevicePageCache` slots. The first ``n_unlimited_layers`` layers attend
their full cache. When the window grows past ``n_win_pages`` pages its oldest page is flushed into
the index, so every token is always reachable (window until flushed, index afterwards).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from icekv.attention import sparse_paged_attention
from icekv.config import SelectionConfig
from icekv.engine.full_attention import FullCacheAttention, request_kv_stats
from icekv.engine.results import KVStats
from icekv.kernels.cpu_decode import sparse_decode_pool_cpu
from icekv.kernels.dispatch import kernel_backend
from icekv.kv import DevicePageCache, PagedKVCache
from icekv.model import ModelArgs
from icekv.policies import sink_tokens, sparse_layers, window_start
from icekv.select import PageSelector


class SparseCacheAttention(FullCacheAttention):
    """Built after prefill, from the request's full cache; decodes one token per step."""

    def __init__(self, cache: PagedKVCache, seq_id: int, args: ModelArgs, cfg: SelectionConfig,
                 selector: PageSelector, probe: bool = False, prebuilt: Callable[[], set[int]] | None = None):
        super().__init__(cache, seq_id)
        self.cfg, self.selector, self.probe = cfg, selector, probe
        p = cfg.page_size
        self.sparse_layers = sparse_layers(cfg, args.num_layers)
        self.sink_end = self._sink_tokens()
        length = cache.length(seq_id)
        self.win_start = self._window_start(length)
        self.timings.update(select_s=0.0, transfer_s=0.0, index_build_s=0.0, insert_s=0.0)
        self.layer_stats: dict[int, list[tuple[float, float]]] = defaultdict(list)  # probe: (recall, cosine)
        t0 = time.perf_counter()  # index_build_s: what the build adds to time to first token
        built = prebuilt() if prebuilt else set()  # layers whose index prefill built (it waits for them)
        for layer in self.sparse_layers:
            if layer not in built:
                selector.build(layer, self._region_keys(layer), self.sink_end)
        self.timings["index_build_s"] = time.perf_counter() - t0
        self.device = {
            layer: DevicePageCache(args.num_kv_heads, cfg.selected_pages, p, args.head_dim, cache.pool.dtype)
            for layer in self.sparse_layers
        }
        # CPU pool and slots: the fill copies straight from the pool's layer views (made once here)
        on_cpu = not cache.pool.is_cuda and all(not d.k.is_cuda for d in self.device.values())
        self.pool_layers = {layer: cache.pool[layer] for layer in self.sparse_layers} if on_cpu else None
        # fp32 pool under the compiled kernels: attention reads sink and window from the pool too
        self.tail_from_pool = cache.pool.dtype == torch.float32 and kernel_backend(cache.pool.device) == "numba"

    # ---- where tokens live (the request's pool); CompressedSparseAttention overrides these
    def _sink_tokens(self) -> int:
        return sink_tokens(self.cfg)

    def _region_keys(self, layer: int):
        """Keys of the indexed region at build time, per KV head: [Hkv, n, D] (or a list of [n_h, D])."""
        return self.cache.gather_range(layer, self.seq_id, self.sink_end, self.win_start)[0]  # win_start >= sink_end

    def _gather_pages(self, layer: int, heads: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        """K/V [2, n, P, D] of selected pages: heads [n], token refs [n, P] from the selector (-1 = empty)."""
        return self.cache.gather_tokens(layer, self.seq_id, heads, refs)

    def _pool_rows(self, layer: int):
        """(pool layer [2, Hkv, pages, P, D], page ids [pages]) that selected tokens are copied from
        when the pool and the slots are both in CPU memory; None: stage them via _gather_pages."""
        if self.pool_layers is None:
            return None
        return self.pool_layers[layer], self.cache.page_ids(self.seq_id)

    def _tail_ranges(self, length: int) -> np.ndarray:
        """[2, 2] position ranges (start, end) of the sink and the window in the request's pages."""
        return np.array([[0, min(self.sink_end, length)], [min(self.win_start, length), length]])

    def _sink_window(self, layer: int, length: int):
        (sink_start, sink_end), (win_start, win_end) = self._tail_ranges(length).tolist()
        sink_k, sink_v = self.cache.view_range(layer, self.seq_id, sink_start, sink_end)
        win_k, win_v = self.cache.view_range(layer, self.seq_id, win_start, win_end)
        return sink_k, sink_v, win_k, win_v

    def _window_start(self, length: int) -> int:
        return window_start(self.cfg, self.sink_end, length)

    def attend(self, layer, q, k, v):
        if layer not in self.device:
            return super().attend(layer, q, k, v)
        if q.shape[0] != 1:
            raise ValueError("sparse attention decodes one token per step")
        self.cache.write(layer, self.seq_id, self.start, k, v)
        length = self.start + 1
        t0 = time.perf_counter()
        selection = self.selector.select(layer, q[0], self.cfg.selected_pages)
        t1 = time.perf_counter()
        dev = self.device[layer]
        source = self._pool_rows(layer)
        if source is not None:  # CPU pool, CPU slots: one compiled pass, straight from the pool
            positions = self.selector.page_positions(layer, selection.heads, selection.pages)  # [n, P]
            dev.fill_from_pool(selection.heads, selection.pages, selection.versions, positions, *source)
        else:
            plan = dev.plan(selection.heads, selection.pages, selection.versions)
            if len(plan):
                positions = self.selector.page_positions(layer, plan.heads, plan.pages)  # [m, P]
                lengths = torch.from_numpy(np.count_nonzero(positions.numpy() >= 0, axis=1))  # [m]
                dev.load(plan, self._gather_pages(layer, plan.heads, positions), lengths)
        t2 = time.perf_counter()
        if source is not None and self.tail_from_pool and q.dtype == torch.float32:
            out = sparse_decode_pool_cpu(q[0], *source, self._tail_ranges(length), dev.k, dev.v, dev.attended_lengths())
        else:
            sink_k, sink_v, win_k, win_v = self._sink_window(layer, length)
            out = sparse_paged_attention(q[0], sink_k, sink_v, dev.k, dev.v, dev.attended_lengths(), win_k, win_v)
        t3 = time.perf_counter()
        self.timings["select_s"] += t1 - t0
        self.timings["transfer_s"] += t2 - t1
        self.timings["attention_s"] += t3 - t2
        if self.probe:
            self._measure(layer, q[0], out, selection, length)
        return out[None]

    def end_step(self) -> None:
        """After every layer has run: flush window pages that fell out of the window."""
        length = self.start + self.positions.numel()
        target = self._window_start(length)
        while self.win_start < target:
            t0 = time.perf_counter()
            for layer in self.sparse_layers:
                keys, _ = self.cache.gather_range(layer, self.seq_id, self.win_start, self.win_start + self.cfg.page_size)
                self.selector.insert(layer, keys)
            self.timings["insert_s"] += time.perf_counter() - t0
            self.win_start += self.cfg.page_size

    # ---- statistics
    def resident_bytes(self) -> int:
        """Bytes on the compute device: full layers, plus sink, window and slots of sparse ones."""
        length = self.cache.length(self.seq_id)
        per_token_layer = self.cache.bytes_per_token // self.cache.num_layers
        full_layers = self.cache.num_layers - len(self.sparse_layers)
        sink_win = min(self.sink_end, length) + max(length - self.win_start, 0)
        slots = sum(d.resident_bytes for d in self.device.values())
        return full_layers * length * per_token_layer + len(self.sparse_layers) * sink_win * per_token_layer + slots

    def kv_stats(self) -> KVStats:
        return request_kv_stats(self.cache, self.seq_id, self.resident_bytes(), **self.transfer_stats())

    def transfer_stats(self) -> dict:
        moved = sum(d.bytes_moved for d in self.device.values())
        hits = sum(d.hits for d in self.device.values())
        lookups = sum(d.lookups for d in self.device.values())
        pages = sum(d.bytes_moved // d.page_bytes for d in self.device.values())
        return {"bytes_moved": moved, "pages_moved": pages, "slot_hit_rate": hits / lookups if lookups else 0.0,
                "index_bytes": self.selector.index_bytes()}

    def _measure(self, layer, q, out, selection, length):
        """Share of the full softmax mass on the attended tokens, and output cosine vs full."""
        keys, values = self.cache.gather_range(layer, self.seq_id, 0, length)  # [Hkv, T, D]
        hkv = keys.shape[0]
        group = q.shape[0] // hkv
        scores = torch.einsum("hgd,htd->hgt", q.view(hkv, group, -1), keys) / keys.shape[-1] ** 0.5
        probs = scores.softmax(-1)  # [Hkv, G, T]
        full_out = torch.einsum("hgt,htd->hgd", probs, values).reshape(q.shape)  # [Hq, D]
        attended = torch.zeros(hkv, length, dtype=torch.bool)
        attended[:, : min(self.sink_end, length)] = True
        attended[:, min(self.win_start, length):] = True
        pos = self.selector.page_positions(layer, selection.heads, selection.pages)  # [n, P]
        attended[selection.heads[:, None].expand_as(pos)[pos >= 0], pos[pos >= 0]] = True
        recall = (probs * attended[:, None, :]).sum(-1).mean().item()
        cosine = F.cosine_similarity(out.float(), full_out.float(), dim=-1).mean().item()
        self.layer_stats[layer].append((recall, cosine))
