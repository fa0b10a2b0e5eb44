"""Full attention: every token of the request (its own pages, after a compressed context if any)."""

from __future__ import annotations

from collections import defaultdict

import torch

from icekv.engine.backends.sources import RequestPages
from icekv.engine.backends.stage_clock import StageClock
from icekv.engine.results import KVStats


class DenseAttention:
    """Writes each layer's new K/V into the request's pages and attends over every token.

    Call :meth:`begin_step` before each forward pass; it reserves the pages for the step.
    """

    def __init__(self, source: RequestPages):
        self.source = source
        self.cache, self.seq_id = source.cache, source.seq_id
        self.start = 0  # own position of this step's first token
        self.positions = torch.zeros(0, dtype=torch.long)  # RoPE positions of this step's tokens
        self.timings: dict[str, float] = defaultdict(float)  # attention_s: gather + attend, all layers
        self.clock = StageClock(self.cache.compute)  # stage times, settled at end_step
        self.layer_stats: dict[int, list[tuple[float, float]]] = {}  # probe: layer -> [(recall, cosine)]
        self.keep_queries = 0  # the prompt's last queries kept per layer (a selector's observation window)
        self.kept_queries: dict[int, torch.Tensor] = {}  # layer -> [<= keep_queries, Hq, D]

    def begin_step(self, n_tokens: int) -> torch.Tensor:
        """Reserve room for ``n_tokens`` new tokens; returns their positions [n_tokens]."""
        self.start = self.cache.extend(self.seq_id, n_tokens)
        self.positions = self.source.offset + torch.arange(self.start, self.start + n_tokens)
        return self.positions

    def attends_all(self, layer: int) -> bool:
        """Does ``layer`` attend every token (so a batch may attend it for this request)?"""
        return True

    def selects(self, layer: int) -> bool:
        """Does ``layer`` attend pages picked by a ``select(layer, q)`` (a step's selections are made
        together; a backend that selects says where it wants ``q``: ``query_device``)?"""
        return False

    def end_step(self) -> None:
        """Called after every layer has run the step: the step's stage times are added up."""
        self.clock.settle(self.timings)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection=None) -> torch.Tensor:
        """q [n, Hq, D], k, v [n, Hkv, D] of this step's tokens -> [n, Hq, D]; ``selection``: the
        layer's pages when it :meth:`selects` (None: picked here)."""
        if self.keep_queries:
            earlier = self.kept_queries.get(layer)
            queries = q if earlier is None else torch.cat([earlier, q])  # [n, Hq, D]
            self.kept_queries[layer] = queries[-self.keep_queries:].clone()
        self.source.write(layer, self.start, k, v)
        t0 = self.clock.mark()
        out = self.source.attend_all(layer, q, self.positions - self.source.offset)
        self.clock.add(self.timings, "attention_s", t0, self.clock.mark())
        return out

    def kv_stats(self) -> KVStats:
        """Everything is resident under full attention."""
        source = self.source
        resident = source.context_bytes(range(self.cache.num_layers)) + self.cache.sequence_bytes(self.seq_id)
        return source.kv_stats(resident)
