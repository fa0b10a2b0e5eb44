"""The compiled insertion bookkeeping follows the build's rules (levels, MIPS projection, parents)."""

import pytest
import torch

from icekv.methods.icecache import IceCacheConfig
from icekv.index import DCITree, promotion_levels
from icekv.index.levels import promotion_step, upper_step
from icekv.index.parents import ROOT, token_level


def _keys(n, d=32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * scale


def _tree(keys, cfg):
    u = torch.randn(keys.shape[1] + 1, generator=torch.Generator().manual_seed(1))
    return DCITree(keys, 16, cfg, u / u.norm())


@pytest.mark.parametrize("cfg", [IceCacheConfig(), IceCacheConfig(ratio_1=0.25, ratio_2=0.5, max_level=3)])
def test_token_level_equals_the_schedule(cfg):
    j = torch.arange(20_000)
    step1, step2 = promotion_step(cfg), upper_step(cfg)
    compiled = torch.tensor([token_level(int(t), step1, step2, cfg.max_level) for t in j])
    assert torch.equal(compiled, promotion_levels(j, cfg))


@pytest.mark.parametrize("cfg", [IceCacheConfig(), IceCacheConfig(ratio_1=0.25, ratio_2=0.5, max_level=3)])
@pytest.mark.parametrize("n0, chunks", [(0, [1, 1, 30]), (1, [16]), (700, [16] * 8), (40, [3, 250]), (100, [40, 7])])
def test_inserted_tokens_get_the_builds_levels_projections_and_parents(cfg, n0, chunks):
    base = _keys(n0)
    tree = _tree(base, cfg)
    extra = _keys(sum(chunks), seed=7, scale=6.0)  # larger norms: M^2 grows during the inserts
    at = 0
    for size in chunks:
        chunk = extra[at : at + size]
        first = tree.n
        tree.insert(chunk)
        at += size
        new = torch.arange(first, tree.n)
        assert torch.equal(tree.level[new], promotion_levels(new, cfg))
        torch.testing.assert_close(tree.norm2[new], chunk.pow(2).sum(-1))
        assert tree.max_norm2 == pytest.approx(float(tree.norm2[: tree.n].max()), rel=1e-6)
        for start in range(0, size, tree.page_size):  # a page at a time: the tokens up to its end are the tree
            end = first + min(start + tree.page_size, size)
            max_norm2 = float(tree.norm2[:end].max())

            def aug(t):
                return (max_norm2 - tree.norm2[t]).clamp_min(0).sqrt()

            piece = torch.arange(first + start, end)
            keys = chunk[piece - first]
            torch.testing.assert_close(tree.proj[piece], keys @ tree.u[:-1] + aug(piece) * tree.u[-1])
            level = tree.level[:end]
            for key, t in zip(keys, piece.tolist()):
                higher = level[level > level[t]]
                if len(higher) == 0:
                    assert int(tree.parent[t]) == ROOT
                    continue
                among = torch.nonzero(level == int(higher.min())).flatten()
                sim = key @ tree.node_keys[among // tree.step].T + aug(t) * aug(among)
                chosen = int(tree.parent[t])
                assert chosen in among.tolist()
                # the nearest (ties to within rounding may pick either)
                assert float(sim[among.tolist().index(chosen)]) >= float(sim.max()) - 1e-4 * max(1.0, float(sim.abs().max()))
    promoted = torch.arange(0, tree.n, tree.step)  # built and inserted: the keys parents are searched among
    assert torch.equal(tree.node_keys[promoted // tree.step], torch.cat([base, extra])[promoted])
