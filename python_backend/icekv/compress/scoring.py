"""Score cached context tokens by the attention that re-fed tokens pay them.

The shared machinery of KV², KVzip and SnapKV: feed some token ids through the model *after*
(or inside) a prefilled context without writing them into the request's cache; every layer's
softmax over [allowed context tokens | fed tokens, causal] is reduced to one score per context
token: the max over fed queries and over the query heads of each KV head.
"""

from __future__ import annotations

from typing import Generator

import torch

from icekv.kv import PagedKVCache


class ScoringAttention:
    """An attention backend that keeps fed tokens' K/V aside and records context scores."""

    def __init__(self, cache: PagedKVCache, seq_id: int, allowed: torch.Tensor, num_layers: int):
        """allowed [T] bool: which context tokens the fed tokens may attend (others are masked)."""
        self.cache, self.seq_id, self.allowed = cache, seq_id, allowed
        self.length = int(allowed.numel())
        self.fed_k: list[torch.Tensor | None] = [None] * num_layers  # [Hkv, F, D] so far
        self.fed_v: list[torch.Tensor | None] = [None] * num_layers
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # [Hkv, T]
        self._context: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer not in self._context:
            self._context[layer] = self.cache.gather_range(layer, self.seq_id, 0, self.length)  # [Hkv, T, D]
        ctx_k, ctx_v = self._context[layer]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, N, D]
        prev_k, prev_v = self.fed_k[layer], self.fed_v[layer]
        fed_k = k if prev_k is None else torch.cat([prev_k, k], 1)  # [Hkv, F, D]
        fed_v = v if prev_v is None else torch.cat([prev_v, v], 1)
        self.fed_k[layer], self.fed_v[layer] = fed_k, fed_v
        n, f, hkv, d = q.shape[0], fed_k.shape[1], k.shape[0], q.shape[-1]
        keys, values = torch.cat([ctx_k, fed_k], 1), torch.cat([ctx_v, fed_v], 1)  # [Hkv, T+F, D]
        causal = torch.arange(f)[None, :] <= torch.arange(f - n, f)[:, None]  # [N, F]
        mask = torch.cat([self.allowed[None, :].expand(n, -1), causal], 1)  # [N, T+F]
        qh = q.permute(1, 0, 2).reshape(hkv, -1, d)  # [Hkv, G*N, D]
        logits = torch.bmm(qh, keys.transpose(1, 2)).view(hkv, -1, n, keys.shape[1]) * d**-0.5  # [Hkv, G, N, T+F]
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
        score = probs[..., : self.length].amax(dim=(1, 2))  # [Hkv, T]
        self.scores[layer] = score if self.scores[layer] is None else torch.maximum(self.scores[layer], score)
        out = torch.bmm(probs.view(hkv, -1, keys.shape[1]), values)  # [Hkv, G*N, D]
        return out.reshape(-1, n, d).transpose(0, 1)


def refeed_steps(model, cache: PagedKVCache, seq_id: int, ids: list[int], positions: list[int],
                 allowed: torch.Tensor, chunk: int = 256) -> Generator[None, None, torch.Tensor]:
    """Feed ``ids`` at ``positions``, yielding after each chunk's model pass; returns the scores
    S [L, Hkv, T] of the context."""
    backend = ScoringAttention(cache, seq_id, allowed, model.args.num_layers)
    for start in range(0, len(ids), chunk):
        model(torch.tensor(ids[start : start + chunk]), torch.tensor(positions[start : start + chunk]), backend,
              logit_rows=torch.tensor([-1]))
        yield
    return torch.stack(backend.scores)  # [L, Hkv, T]


def refeed_scores(*args, **kwargs) -> torch.Tensor:
    """:func:`refeed_steps` run to its end."""
    steps = refeed_steps(*args, **kwargs)
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def keydiff_scores(cache: PagedKVCache, seq_id: int, num_layers: int, chunk: int = 4096) -> torch.Tensor:
    """KeyDiff: -cos(k_j, mean of the chunk's normalised keys), per layer and KV head -> [L, Hkv, T]."""
    length = cache.length(seq_id)
    out = []
    for layer in range(num_layers):
        keys, _ = cache.gather_range(layer, seq_id, 0, length)  # [Hkv, T, D]
        keys = torch.nn.functional.normalize(keys.float(), dim=-1)
        parts = []
        for c in keys.split(chunk, dim=1):
            anchor = torch.nn.functional.normalize(c.mean(1, keepdim=True), dim=-1)  # [Hkv, 1, D]
            parts.append(-(c * anchor).sum(-1))  # [Hkv, C]
        out.append(torch.cat(parts, 1))
    return torch.stack(out)  # [L, Hkv, T]
