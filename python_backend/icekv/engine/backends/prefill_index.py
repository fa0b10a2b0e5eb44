"""A sparse policy's index, built layer by layer while the prompt is prefilled.

Built after prefill, every layer's index adds to the time to the first token. Here, as soon as
prefill has written a layer's indexed region (the prompt between the sink and the window: final
once the chunk that reaches the window has passed that layer), the region is copied out and a
worker thread builds that layer's index while the forward pass goes on through the remaining
layers and chunks. The build runs in torch and numba, which release the GIL, so it runs beside
the forward pass; the first decode step waits only for what is left. It pays where the build has
cores of its own (``EngineConfig.index_threads``: by default the cores the forward pass leaves
free); on cores the forward pass uses, it slows prefill by about what it saves.

A prefill-built index serves the first decode under the same :class:`PolicyPlan` (decodes under
other plans leave it be): decoding changes it (window pages are inserted), so a second decode
under that plan builds afresh. Releasing the request stops builds still running.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numba
import torch

from icekv.engine.backends.dense import DenseAttention
from icekv.engine.backends.sources import RequestPages
from icekv.kv import PagedKVCache
from icekv.methods.selector import PageSelector
from icekv.model import ModelArgs
from icekv.policies import PolicyPlan


class PrefillIndex:
    """Per-layer index builds started during one request's prefill, for one plan."""

    def __init__(self, plan: PolicyPlan, selector: PageSelector, threads: int = 1,
                 device: torch.device = torch.device("cpu")):
        self.plan, self.selector, self.device = plan, selector, device
        self.builds: dict[int, Future] = {}  # layer -> its build on the worker
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="icekv-index",
                                          initializer=_use_threads, initargs=(threads,))

    def submit(self, layer: int, keys: torch.Tensor, base: int) -> None:
        """Build ``layer``'s index from its region's keys [Hkv, n, D] (position of key 0: ``base``),
        held in host memory until the build moves them to ``device`` (builds may queue up)."""
        self.builds[layer] = self._worker.submit(self._build, layer, keys.cpu(), base)

    def _build(self, layer: int, keys: torch.Tensor, base: int) -> None:
        self.selector.build(layer, keys.to(self.device), base)

    def wait(self) -> set[int]:
        """Block until every started build is done; the layers they built. A failed build raises."""
        try:
            for build in self.builds.values():
                build.result()
        finally:
            self._worker.shutdown(wait=True)
        return set(self.builds)

    def cancel(self) -> None:
        """Drop builds not yet started and wait for the running one (it reads only its own copy)."""
        self._worker.shutdown(wait=True, cancel_futures=True)


def _use_threads(n: int) -> None:
    """The worker's own thread counts (both are per calling thread): the forward pass keeps its."""
    torch.set_num_threads(n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


class IndexingPrefillAttention(DenseAttention):
    """Full attention for prefill that also starts ``index``'s per-layer builds for a prompt of
    ``prompt_tokens`` tokens (``chunk_tokens`` at most a step), each as soon as that layer has
    written its indexed region."""

    def __init__(self, cache: PagedKVCache, seq_id: int, args: ModelArgs, prompt_tokens: int, chunk_tokens: int,
                 index: PrefillIndex):
        super().__init__(RequestPages(cache, seq_id, prompt_tokens, chunk_tokens))
        self.index = index
        plan = index.plan
        self.layers = plan.index_layers(args)
        self.sink_end = plan.sink_tokens
        self.region_end = plan.window_start(self.sink_end, prompt_tokens)
        self.final_at = min(self.region_end, prompt_tokens)  # written up to here, the region is final

    def attend(self, layer, q, k, v, selection=None):
        out = super().attend(layer, q, k, v)
        written = self.cache.length(self.seq_id)  # this chunk's end: the layer has written up to it
        if layer in self.layers and layer not in self.index.builds and written >= self.final_at:
            keys, _ = self.cache.gather_range(layer, self.seq_id, self.sink_end, self.region_end)  # [Hkv, n, D]
            self.index.submit(layer, keys, self.sink_end)
        return out
