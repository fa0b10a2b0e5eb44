"""Decoding under MagicPIG: exact attention over sink and window, an importance-weighted estimate
over the tokens the query's LSH buckets sample from the indexed region, merged by log-sum-exp.

The sampled part runs where the pool is (host memory), as in MagicPIG, where the CPU computes it
and only its output and log-sum-exp join the device's exact part; no page moves to device slots.
"""

from __future__ import annotations

import torch

from icekv.attention.sampled import attention_lse, merge_lse
from icekv.engine.backends.sparse import SparseAttention
from icekv.methods.magicpig import Samples, sample_log_weights


class SampledAttention(SparseAttention):
    def selects(self, layer):
        return False  # it samples tokens in its own attend

    def attend(self, layer, q, k, v, selection=None):
        if layer not in self.device:
            return super().attend(layer, q, k, v)
        self.source.write(layer, self.start, k, v)
        self.tails[layer].append(self.start, k[0], v[0])
        sink_k, sink_v, win_k, win_v = self.tails[layer].views()  # [Hkv, n, D] each
        clock = self.clock
        t0 = clock.mark()
        query = q[0]  # [Hq, D]
        hq, hkv = query.shape[0], k.shape[1]
        samples = self.selector.sample(layer, query, self.plan.selected_pages * self.plan.page_size)
        t1 = clock.mark()
        heads = torch.arange(hq) // (hq // hkv)  # [Hq] each query head's KV head
        rows = self.source.gather_pages(layer, heads, samples.positions)  # [2, Hq, M, W] where the pool is
        kv = self.cache.kv_format.unpack(rows, self.cache.dtype)  # [2, Hq, M, D] the samples' values
        t2 = clock.mark()
        where = kv.device  # the sampled part is computed where the pool is
        on_pool = Samples(*(t.to(where) for t in (samples.positions, samples.norms, samples.mean, samples.kept_share)))
        host_q = query.to(where)
        log_w = sample_log_weights(host_q, kv[0], on_pool, self.selector.config)  # [Hq, M]
        out_s, lse_s = attention_lse(host_q, kv[0], kv[1], bias=-log_w, valid=on_pool.positions >= 0)
        exact = [torch.cat(pair, 1).repeat_interleave(hq // hkv, 0) for pair in ((sink_k, win_k), (sink_v, win_v))]
        out_e, lse_e = attention_lse(query, *exact)  # [Hq, D], [Hq]
        out = merge_lse(out_e, lse_e, out_s.to(out_e.device), lse_s.to(lse_e.device)).to(query.dtype)
        t3 = clock.mark()
        clock.add(self.timings, "select_s", t0, t1)
        clock.add(self.timings, "transfer_s", t1, t2)
        clock.add(self.timings, "attention_s", t2, t3)
        if self.probe:
            self._measure_samples(layer, query, out, samples.positions, self.start + 1)
        return out[None]

    def _measure_samples(self, layer, q, out, positions, length):
        """The probe of a step that attended sink, window and each query head's samples."""
        attended = self._sink_and_window(length, q.shape[0])  # [Hq, T]
        rows, cols = (positions >= 0).nonzero(as_tuple=True)
        attended[rows, positions[rows, cols]] = True
        self._record_probe(layer, q, out, attended, length)
