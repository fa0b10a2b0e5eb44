"""MagicPIG: SimHash tables over mean-centred keys; the tokens a query collides with are sampled.

At build, per layer and KV head, the region keys (post-RoPE) are centred by their mean and hashed
by one set of random hyperplanes shared by every layer and head (the authors' code): ``tables``
tables of ``bits`` bits each. Each step a query (not centred: only its signs matter) is hashed
the same way, and a token is sampled when its bucket equals the query's in at least
``min_collisions`` tables. Each sampled token carries its sampling probability (from the angle
between the query and its centred key), so its attention is estimated with importance weights
(:class:`icekv.engine.backends.sampled.SampledAttention`). Beyond the budget's selected tokens, a
uniform share of the collided ones is kept and their probability scaled by that share, which
keeps the estimate unbiased. Tokens flushed out of the window are hashed as they join (in the
authors' code decode tokens stay in the exact local part: that part is a fixed window here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from icekv.errors import ConfigError
from icekv.index.lsh import collision_counts, simhash
from icekv.methods.base import Policy, layers_outside, scale_layers

if TYPE_CHECKING:
    from icekv.model import ModelArgs
    from icekv.policies import PolicyPlan


@dataclass(frozen=True)
class MagicPIGConfig:
    """MagicPIG (Infini-AI-Lab/MagicPIG): SimHash tables over mean-centred keys, sampled attention."""

    bits: int = 10  # K: hyperplanes per table
    tables: int = 150  # L
    min_collisions: int = 2  # a key is sampled when it shares the query's bucket in this many tables
    dense: tuple[int, ...] = (0, 16)  # layers attended in full, of a 32-layer model (Llama-3.1-8B's)
    reference_depth: int = 32
    seed: int = 0  # the hyperplanes (one set for every layer and head, as in the authors' code)

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 15 or self.tables < 1 or not 1 <= self.min_collisions <= self.tables:
            raise ConfigError("magicpig needs 1 <= bits <= 15, tables >= 1 and 1 <= min_collisions <= tables")

    def dense_layers(self, num_layers: int) -> frozenset[int]:
        return frozenset(scale_layers(self.dense, self.reference_depth, num_layers))


def hyperplanes(dim: int, cfg: MagicPIGConfig) -> torch.Tensor:
    """[D, tables * bits] Gaussian hyperplanes."""
    return torch.randn(dim, cfg.tables * cfg.bits, generator=torch.Generator().manual_seed(cfg.seed))


def sampling_probability(cos: torch.Tensor, cfg: MagicPIGConfig) -> torch.Tensor:
    """The chance that a key at cosine ``cos`` to the query shares its bucket in at least
    ``min_collisions`` of the tables: one table collides with p = (1 - theta/pi)^bits, and the
    count over the tables is binomial (for 2 this is the authors' 1 - (1-p)^L - L p (1-p)^(L-1))."""
    p = (1 - torch.arccos(cos.clamp(-1, 1)) / math.pi) ** cfg.bits
    n = cfg.tables
    below = torch.zeros_like(p)
    for i in range(cfg.min_collisions):  # P(count = i), i < min_collisions
        log_choose = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
        below = below + torch.exp(log_choose + i * torch.log(p.clamp_min(1e-30)) + (n - i) * torch.log1p(-p.clamp_max(1 - 1e-7)))
    return (1 - below).clamp_min(0)


def sample_log_weights(q: torch.Tensor, keys: torch.Tensor, samples: "Samples", cfg: MagicPIGConfig) -> torch.Tensor:
    """q [Hq, D], the sampled tokens' keys [Hq, M, D] -> the log of each one's sampling
    probability [Hq, M] (times the share the cap kept; + 1e-4 inside the log, as the authors'),
    from the cosine between q and the centred key."""
    q = q.float()
    centred_dot = torch.einsum("hd,hmd->hm", q, keys.float()) - (q * samples.mean).sum(-1, keepdim=True)  # q.(k - mean)
    cos = centred_dot / (q.norm(dim=-1, keepdim=True) * samples.norms).clamp_min(1e-12)
    return torch.log(sampling_probability(cos, cfg) * samples.kept_share[:, None] + 1e-4)


@dataclass(frozen=True)
class Samples:
    """One layer's sampled tokens per query head: positions [Hq, M] (-1: padding), and what their
    weights need: the centred keys' norms [Hq, M], the key mean [Hq, D] and the share of the
    collided tokens the cap kept [Hq]."""

    positions: torch.Tensor
    norms: torch.Tensor
    mean: torch.Tensor
    kept_share: torch.Tensor


@dataclass
class MagicPIGSelector:
    page_size: int = 16
    config: MagicPIGConfig = field(default_factory=MagicPIGConfig)
    planes: torch.Tensor | None = field(init=False, default=None)  # [D, L*K]
    base: dict = field(init=False, default_factory=dict)
    mean: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, D]
    codes: dict = field(init=False, default_factory=dict)  # layer -> [Hkv, n, L] int16
    norms: dict = field(init=False, default_factory=dict)  # layer -> centred key norms [Hkv, n]
    sampled: list = field(init=False, default_factory=lambda: [0, 0, None, None])  # calls, total, fewest, most
    _rng: torch.Generator = field(init=False, default_factory=lambda: torch.Generator().manual_seed(0))

    def build(self, layer, keys, base):
        keys = keys.cpu().float()  # the tables are kept and searched on the host
        if self.planes is None:
            self.planes = hyperplanes(keys.shape[-1], self.config)
        self.base[layer] = base
        self.mean[layer] = keys.mean(1) if keys.shape[1] else torch.zeros(keys.shape[0], keys.shape[-1])
        self.codes[layer], self.norms[layer] = self._hash(layer, keys)

    def _hash(self, layer, keys):
        centred = keys - self.mean[layer][:, None]  # [Hkv, n, D]
        return simhash(centred, self.planes, self.config.bits), centred.norm(dim=-1)

    def insert(self, layer, keys):
        keys = keys.cpu().float()
        if self.codes[layer].shape[1] == 0:  # nothing was indexed at build: the first page sets the mean
            self.mean[layer] = keys[:, : self.page_size].mean(1)
        codes, norms = self._hash(layer, keys)
        self.codes[layer] = torch.cat([self.codes[layer], codes], 1)
        self.norms[layer] = torch.cat([self.norms[layer], norms], 1)

    def sample(self, layer: int, q: torch.Tensor, cap: int) -> Samples:
        """q [Hq, D] -> the tokens each query head samples, at most ``cap`` per head."""
        codes = self.codes[layer]  # [Hkv, n, L]
        hkv, n, _ = codes.shape
        hq = q.shape[0]
        q_codes = simhash(q.cpu(), self.planes, self.config.bits).view(hkv, hq // hkv, -1)  # [Hkv, G, L]
        hits = collision_counts(codes, q_codes).view(hq, n) >= self.config.min_collisions  # [Hq, n]
        width = min(cap, n)
        positions = torch.full((hq, width), -1, dtype=torch.long)
        share = torch.ones(hq)
        for h in range(hq):  # at most a few dozen heads
            ids = hits[h].nonzero()[:, 0]
            self._count(len(ids))
            if len(ids) > cap:  # a uniform share of them, their probability scaled by it
                share[h] = cap / len(ids)
                ids = ids[torch.randperm(len(ids), generator=self._rng)[:cap]].sort().values
            positions[h, : len(ids)] = self.base[layer] + ids
        kv = torch.arange(hq) // (hq // hkv)
        local = (positions - self.base[layer]).clamp_min(0)
        return Samples(positions, self.norms[layer][kv[:, None], local], self.mean[layer][kv], share)

    def _count(self, n: int) -> None:
        calls, total, fewest, most = self.sampled
        self.sampled = [calls + 1, total + n, n if fewest is None else min(fewest, n), max(most or 0, n)]

    def index_bytes(self) -> int:
        return sum(t.nbytes for d in (self.codes, self.norms, self.mean) for t in d.values())

    def device_bytes(self) -> int:
        return 0  # tables, search and the sampled attention stay on the host

    def bytes_to_device(self) -> int:
        return 0


def _budgeted(plan: PolicyPlan, num_layers: int) -> tuple[int, ...]:
    """Every layer but MagicPIG's own dense ones (:meth:`MagicPIGConfig.dense_layers`)."""
    return layers_outside(plan.selection.magicpig.dense_layers(num_layers), num_layers)


def _index_bytes(plan: PolicyPlan, args: ModelArgs, tokens: int, dtype: str) -> int:
    """A 2-byte bucket per table and an fp32 centred-key norm per token, per budgeted layer and KV head."""
    layers = len(plan.sparse_layers(args))
    return layers * args.num_kv_heads * (tokens * (2 * plan.selection.magicpig.tables + 4) + args.head_dim * 4)


POLICY = Policy("magicpig", selector=lambda plan: MagicPIGSelector(plan.page_size, plan.selection.magicpig),
                budgeted_layers=_budgeted, index_bytes=_index_bytes, sampled=True)
