"""Score cached context tokens by the attention that re-fed tokens pay them.

The shared machinery of KV², KVzip and SnapKV: feed some token ids through the model *after*
(or inside) a prefilled context without writing them into the request's cache; every layer's
softmax over [scored context tokens | fed tokens, causal] is reduced to one score per context
token: the max over fed queries and over the query heads of each KV head.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Generator

import torch

from icekv.kv import PagedKVCache
from icekv.model.weights import dense_weight


@dataclass(frozen=True)
class ScoringContext:
    """What a compressor sees: a context prefilled into ``cache`` as request ``seq_id`` (its token
    ``ids``), the ``model`` that can re-feed tokens after it, ``encode`` for a method's own prompt
    text, and ``kv_budget``, the share of the context's KV the caller will keep."""

    model: object
    cache: PagedKVCache
    seq_id: int
    ids: list[int]
    encode: Callable[[str], list[int]]
    kv_budget: float

    @property
    def num_layers(self) -> int:
        return self.model.args.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.args.num_kv_heads

    def refeed(self, ids: list[int], positions: list[int], scored: torch.Tensor, **options):
        """:func:`refeed_steps` after this context."""
        return refeed_steps(self.model, self.cache, self.seq_id, ids, positions, scored, **options)

    def keydiff(self, chunk: int) -> torch.Tensor:
        """:func:`keydiff_scores` of this context [L, Hkv, T]."""
        return keydiff_scores(self.cache, self.seq_id, self.num_layers, chunk)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) spans of consecutive True entries of a bool vector."""
    edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8)).nonzero().squeeze(1).tolist()
    return list(zip(edges[0::2], edges[1::2]))


class ScoringAttention:
    """An attention backend that keeps fed tokens' K/V aside and records context scores.

    Only the context tokens the fed tokens attend are read: with KV²'s per-chunk scoring, a chunk
    and the sinks, so its cost grows with the chunk, not with the whole context.
    """

    def __init__(self, cache: PagedKVCache, seq_id: int, scored: torch.Tensor, num_layers: int,
                 visible: torch.Tensor | None = None, out_proj: list[torch.Tensor] | None = None):
        """scored [T] bool: the context tokens the score softmax runs over (the rest score 0).
        visible [T] bool: the context tokens the fed tokens' outputs attend (None: ``scored``;
        it must include them).
        out_proj: each layer's output projection weight [hidden, Hq*D]; given, a weight a[i, j] is
        scaled by ||W_o v_j|| / ||h_i|| (what token j would add to the output, per unit of the
        query's input; KVzip+/KV²+), with ||h_i|| recorded by :meth:`record_input` before each layer."""
        visible = scored if visible is None else visible
        if bool((scored & ~visible).any()):
            raise ValueError("every scored context token must be visible")
        self.cache, self.seq_id, self.out_proj = cache, seq_id, out_proj
        self.length = int(scored.numel())
        self.read_at = visible.nonzero().squeeze(1)  # [K]: the context positions read
        self._spans = _runs(visible)
        self._whole = self._spans == [(0, self.length)]  # then read once per layer and kept
        self._scored = scored[self.read_at]  # [K]
        self._one_softmax = bool(self._scored.all())  # outputs and scores over the same tokens
        self.fed_k: list[torch.Tensor | None] = [None] * num_layers  # [Hkv, F, D] so far
        self.fed_v: list[torch.Tensor | None] = [None] * num_layers
        self.scores: list[torch.Tensor | None] = [None] * num_layers  # [Hkv, T]
        self._context: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._value_norms: dict[int, torch.Tensor] = {}  # layer -> [Hq, K]
        self._input_norms: dict[int, torch.Tensor] = {}  # layer -> [N] for the pass in flight

    def record_input(self, layer: int, x: torch.Tensor) -> None:
        """x [N, hidden]: the attention's input for the fed tokens (normalised scores only)."""
        self._input_norms[layer] = x.float().norm(dim=-1)  # [N]

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The visible context's keys and values, two [Hkv, K, D]."""
        if layer in self._context:
            return self._context[layer]
        parts = [self.cache.gather_range(layer, self.seq_id, a, b) for a, b in self._spans]
        kv = parts[0] if len(parts) == 1 else (torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1))
        kv = tuple(self.cache.to_compute(t) for t in kv)
        if self._whole:
            self._context[layer] = kv
        return kv

    def _value_norm(self, layer: int, ctx_v: torch.Tensor, n_heads: int) -> torch.Tensor:
        """||W_o,h v_j|| for every query head h and read context token j -> [Hq, K]."""
        if layer in self._value_norms:
            return self._value_norms[layer]
        hkv, _, d = ctx_v.shape
        w = self.out_proj[layer].float().view(-1, n_heads, d)  # [hidden, Hq, D]
        gram = torch.einsum("xhd,xhe->hde", w, w)  # [Hq, D, D]: W_h^T W_h
        v = ctx_v.float().repeat_interleave(n_heads // hkv, dim=0)  # [Hq, K, D]
        norms = torch.einsum("hkd,hde,hke->hk", v, gram, v).clamp_min(0).sqrt()  # [Hq, K]
        if self._whole:
            self._value_norms[layer] = norms
        return norms

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = self._read(layer)  # [Hkv, K, D]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, N, D]
        prev_k, prev_v = self.fed_k[layer], self.fed_v[layer]
        fed_k = k if prev_k is None else torch.cat([prev_k, k], 1)  # [Hkv, F, D]
        fed_v = v if prev_v is None else torch.cat([prev_v, v], 1)
        self.fed_k[layer], self.fed_v[layer] = fed_k, fed_v
        n, f, hkv, d = q.shape[0], fed_k.shape[1], k.shape[0], q.shape[-1]
        kk = ctx_k.shape[1]
        keys, values = torch.cat([ctx_k, fed_k], 1), torch.cat([ctx_v, fed_v], 1)  # [Hkv, K+F, D]
        at = torch.arange(f, device=q.device)
        causal = at[None, :] <= at[f - n :, None]  # [N, F]
        qh = q.permute(1, 0, 2).reshape(hkv, -1, d) * d**-0.5  # [Hkv, G*N, D], scaled here, not the context-sized logits
        logits = torch.bmm(qh, keys.transpose(1, 2)).view(hkv, -1, n, kk + f)  # [Hkv, G, N, K+F]
        output_logits = None  # the outputs' own softmax, where they attend more of the context than is scored
        if not self._one_softmax:
            seen = torch.cat([torch.ones(n, kk, dtype=torch.bool, device=q.device), causal], 1)  # [N, K+F]
            output_logits = logits.masked_fill(~seen, float("-inf"))
        score_mask = torch.cat([self._scored.to(q.device)[None, :].expand(n, -1), causal], 1)  # [N, K+F]
        score_probs = logits.masked_fill_(~score_mask, float("-inf")).softmax(-1)  # [Hkv, G, N, K+F]
        del logits
        weights = score_probs[..., :kk]  # [Hkv, G, N, K]
        if self.out_proj is not None:
            value_norm = self._value_norm(layer, ctx_v, q.shape[1]).view(hkv, -1, 1, kk)  # [Hkv, G, 1, K]
            weights = weights * value_norm / self._input_norms[layer].clamp_min(1e-6).view(1, 1, n, 1)
        score = torch.zeros(hkv, self.length)
        score[:, self.read_at] = weights.amax(dim=(1, 2)).float().cpu()  # [Hkv, T]
        self.scores[layer] = score if self.scores[layer] is None else torch.maximum(self.scores[layer], score)
        del weights
        probs = score_probs if output_logits is None else output_logits.softmax(-1)
        out = torch.bmm(probs.view(hkv, -1, kk + f), values)  # [Hkv, G*N, D]
        return out.reshape(-1, n, d).transpose(0, 1)


@contextmanager
def _recording_inputs(model, backend: ScoringAttention):
    """While the block runs, each layer's attention input is handed to ``backend.record_input``."""
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, i=i: backend.record_input(i, args[0])) for i, layer in enumerate(model.layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def refeed_steps(model, cache: PagedKVCache, seq_id: int, ids: list[int], positions: list[int],
                 scored: torch.Tensor, chunk: int = 256, visible: torch.Tensor | None = None,
                 normalize: bool = False) -> Generator[None, None, torch.Tensor]:
    """Feed ``ids`` at ``positions``, yielding after each chunk's model pass; returns the scores
    S [L, Hkv, T] of the context (see :class:`ScoringAttention` for ``scored``, ``visible`` and
    ``normalize``)."""
    out_proj = [dense_weight(layer.self_attn.o_proj) for layer in model.layers] if normalize else None
    backend = ScoringAttention(cache, seq_id, scored, model.args.num_layers, visible, out_proj)
    device, last = cache.compute, torch.tensor([-1], device=cache.compute)
    for start in range(0, len(ids), chunk):
        tokens = torch.tensor(ids[start : start + chunk], device=device)
        at = torch.tensor(positions[start : start + chunk], device=device)
        if normalize:
            with _recording_inputs(model, backend):
                model(tokens, at, backend, logit_rows=last)
        else:
            model(tokens, at, backend, logit_rows=last)
        yield
    return torch.stack(backend.scores)  # [L, Hkv, T]


def run_steps(steps: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """A scoring generator (``score_steps``, :func:`refeed_steps`) run to its end: its scores."""
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


def refeed_scores(*args, **kwargs) -> torch.Tensor:
    """:func:`refeed_steps` run to its end."""
    return run_steps(refeed_steps(*args, **kwargs))


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
        out.append(torch.cat(parts, 1).cpu())
    return torch.stack(out)  # [L, Hkv, T]
