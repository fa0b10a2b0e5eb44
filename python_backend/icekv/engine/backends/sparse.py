"""Budgeted decoding: sink + selected pages + window, per KV head, over any token source.

The pool owns every token of every layer. Per layer and KV head, the tokens between the sink and
the window are the *indexed region*; a selector groups them into pages and picks ``k`` per step,
and only those move into the layer's :class:`DevicePageCache` slots. The first
``n_unlimited_layers`` layers attend everything. When the window grows past its pages
its oldest page is flushed into the index, so every token is always reachable (window until
flushed, index afterwards).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F

from icekv.engine.backends.dense import DenseAttention
from icekv.engine.backends.sources import RequestPages
from icekv.engine.backends.tail import DeviceTail, PoolTail
from icekv.engine.results import KVStats
from icekv.kernels import scatter_pages
from icekv.kernels.cpu_decode import compiled_reads
from icekv.kernels.dispatch import kernel_backend
from icekv.kv import DevicePageCache
from icekv.model import ModelArgs
from icekv.methods.selector import PageSelector, Selection, query_device
from icekv.policies import PolicyPlan
from icekv.sizing import local_tokens_held


class SparseAttention(DenseAttention):
    """Built after prefill, from the request's cache; decodes one token per step. ``prebuilt``
    waits for the layers whose index prefill built and names them; ``window_queries`` (layer ->
    [W, Hq, D]) are the prompt's last queries, for a selector that needs them before it builds.
    ``indexed_until``: ``selector`` is a finished request's index over this prompt's first tokens,
    its region ending there; only the tokens from there to the window are inserted."""

    def __init__(self, source: RequestPages, args: ModelArgs, plan: PolicyPlan, selector: PageSelector,
                 probe: bool = False, prebuilt: Callable[[], set[int]] | None = None,
                 window_queries: dict[int, torch.Tensor] | None = None, indexed_until: int | None = None):
        super().__init__(source)
        self.plan, self.selector, self.probe = plan, selector, probe
        self.sparse_layers = plan.sparse_layers(args)
        self.index_layers = plan.index_layers(args)
        self.watched = frozenset(self.index_layers) - frozenset(self.sparse_layers)  # dense, their query observed
        self.sink_end = source.sink_end(plan)
        self.win_start = plan.window_start(self.sink_end, source.length())
        self.timings.update(select_s=0.0, transfer_s=0.0, index_build_s=0.0, insert_s=0.0)
        self.layer_stats = defaultdict(list)  # probe: layer -> [(recall, cosine)] of its decode steps
        t0 = time.perf_counter()  # index_build_s: what the build adds to time to first token
        built = prebuilt() if prebuilt else set()
        length = source.length()
        for layer in self.index_layers:
            if layer in built:
                continue
            if plan.window_queries:
                queries = (window_queries or {}).get(layer)
                if queries is None:
                    raise ValueError(f"the {plan.name} policy needs the prompt's last queries: decode with a suffix "
                                     "or over a prompt prefilled for later decodes")
                selector.observe_prompt(layer, queries, source.region_keys(layer, 0, length))
            if indexed_until is not None:
                self._insert_pages(layer, indexed_until, self.win_start)
            else:
                selector.build(layer, source.region_keys(layer, self.sink_end, self.win_start), self.sink_end)
        self.timings["index_build_s"] = time.perf_counter() - t0
        pool = self.cache.pool  # [L, 2, Hkv, pages, P, W]: slots hold the same stored rows
        self.device = {
            layer: DevicePageCache(args.num_kv_heads, plan.selected_pages, plan.page_size, pool.shape[-1],
                                   pool.dtype, self.cache.compute, scatter=scatter_pages)
            for layer in self.sparse_layers
        }
        # pool and slots in CPU memory, fp32 or bf16 values: the compiled kernel reads sink and window
        # from the pool in place; otherwise they are kept on the compute device (copied once, then appended)
        compiled = (compiled_reads(self.cache.dtype, pool.dtype, self.cache.kv_format)
                    and kernel_backend(pool.device) == "numba")
        in_place = compiled and all(source.pool_rows(layer) is not None for layer in self.sparse_layers)
        self.tails = {
            layer: PoolTail(source, layer, self.sink_end, self.win_start, length) if in_place else
            DeviceTail(*source.sink_window(layer, self.sink_end, self.win_start, length), self.win_start,
                       plan.window_tokens, self.cache.kv_format)
            for layer in self.sparse_layers
        }

    def attends_all(self, layer: int) -> bool:
        return layer not in self.device and layer not in self.watched  # the unlimited layers (a watched one observes)

    def selects(self, layer):
        return layer in self.device

    @property
    def query_device(self):
        return query_device(self.selector, self.cache.compute)

    def select(self, layer: int, q: torch.Tensor) -> Selection:
        """The pages ``layer`` attends this step for its decode query q [Hq, D] (on :attr:`query_device`)."""
        t0 = self.clock.mark()
        selection = self.selector.select(layer, q, self.plan.selected_pages)
        self.clock.add(self.timings, "select_s", t0, self.clock.mark())
        return selection

    def attend(self, layer, q, k, v, selection=None):
        if layer not in self.device:
            if layer in self.watched:
                self.selector.observe(layer, q[-1])
            return super().attend(layer, q, k, v)
        if q.shape[0] != 1:
            raise ValueError("sparse attention decodes one token per step")
        if selection is None:
            selection = self.select(layer, q[0].to(self.query_device))
        self.source.write(layer, self.start, k, v)
        tail, dev = self.tails[layer], self.device[layer]
        tail.append(self.start, k[0], v[0])
        clock = self.clock
        t1 = clock.mark()
        dev.fill(selection, lambda heads, pages: self.selector.page_positions(layer, heads, pages),
                 self.source.pool_rows(layer), lambda heads, refs, out: self.source.gather_pages(layer, heads, refs, out))
        t2 = clock.mark()
        out = tail.attend(q[0], dev)
        t3 = clock.mark()
        clock.add(self.timings, "transfer_s", t1, t2)
        clock.add(self.timings, "attention_s", t2, t3)
        if self.probe:
            self._measure(layer, q[0], out, selection, self.start + 1)
        return out[None]

    def end_step(self) -> None:
        """After every layer has run: the step's stage times are added up, window pages that fell
        out of the window flushed."""
        self.clock.settle(self.timings)
        length = self.start + self.positions.numel()
        target = self.plan.window_start(self.sink_end, length)
        if self.win_start < target:
            t0 = time.perf_counter()
            for layer in self.index_layers:
                self._insert_pages(layer, self.win_start, target)
            self.timings["insert_s"] += time.perf_counter() - t0
            self.win_start = target
        for tail in self.tails.values():
            tail.advance(self.win_start)

    def _insert_pages(self, layer: int, start: int, end: int) -> None:
        """The request's own tokens [start, end) (whole pages) into ``layer``'s index, in one call."""
        if start < end:
            keys, _ = self.cache.gather_range(layer, self.seq_id, start, end)  # [Hkv, end - start, D]
            self.selector.insert(layer, keys.cpu())

    # ---- statistics
    def resident_bytes(self) -> int:
        """Bytes on the compute device: dense layers whole (a local one: about its window); sink,
        window and slots of sparse ones; what the selector keeps there."""
        length = self.source.length()
        per_token_layer = self.cache.bytes_per_token // self.cache.num_layers
        dense = [layer for layer in range(self.cache.num_layers) if layer not in self.device]
        windows = [self.cache.window(layer) for layer in dense]
        held = sum(length if w is None else local_tokens_held(w, length) for w in windows)
        tail = self.source.sink_tokens_held(self.sink_end) + max(length - self.win_start, 0)
        slots = sum(d.resident_bytes for d in self.device.values())
        return (self.source.context_bytes(dense) + held * per_token_layer
                + len(self.sparse_layers) * tail * per_token_layer + slots + self.selector.device_bytes())

    def kv_stats(self) -> KVStats:
        moved = sum(d.bytes_moved for d in self.device.values())
        hits = sum(d.hits for d in self.device.values())
        lookups = sum(d.lookups for d in self.device.values())
        pages = sum(d.bytes_moved // d.page_bytes for d in self.device.values())
        return self.source.kv_stats(self.resident_bytes(), bytes_moved=moved, pages_moved=pages,
                                    slot_hit_rate=hits / lookups if lookups else 0.0,
                                    index_bytes=self.selector.index_bytes(),
                                    index_bytes_moved=self.selector.bytes_to_device())

    def _measure(self, layer, q, out, selection, length):
        """The probe of a step that attended sink, window and the selected pages of each KV head."""
        attended = self._sink_and_window(length, len(self.device[layer].k))  # [Hkv, T]
        pos = self.selector.page_positions(layer, selection.heads, selection.pages)  # [n, P]
        attended[selection.heads[:, None].expand_as(pos)[pos >= 0], pos[pos >= 0]] = True
        group = q.shape[0] // attended.shape[0]
        self._record_probe(layer, q, out, attended.repeat_interleave(group, 0), length)

    def _sink_and_window(self, length: int, rows: int) -> torch.Tensor:
        """[rows, T]: True on the sink and the window (attended by every head)."""
        attended = torch.zeros(rows, length, dtype=torch.bool)
        attended[:, : min(self.sink_end, length)] = True
        attended[:, min(self.win_start, length):] = True
        return attended

    def _record_probe(self, layer, q, out, attended, length):
        """Share of the full softmax mass on the tokens each query head attended (``attended``
        [Hq, T]), and output cosine vs full attention (own tokens only: the probe runs without a
        compressed context)."""
        keys, values = self.cache.gather_range(layer, self.seq_id, 0, length)  # [Hkv, T, D]
        keys, values = self.cache.to_compute(keys), self.cache.to_compute(values)
        hkv = keys.shape[0]
        group = q.shape[0] // hkv
        scores = torch.einsum("hgd,htd->hgt", q.view(hkv, group, -1), keys) / keys.shape[-1] ** 0.5
        probs = scores.softmax(-1)  # [Hkv, G, T]
        full_out = torch.einsum("hgt,htd->hgd", probs, values).reshape(q.shape)  # [Hq, D]
        recall = (probs.reshape(q.shape[0], length) * attended.to(q.device)).sum(-1).mean().item()
        cosine = F.cosine_similarity(out.float(), full_out.float(), dim=-1).mean().item()
        self.layer_stats[layer].append((recall, cosine))
