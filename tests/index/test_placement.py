"""The compiled token placement against its numpy reference, on a real tree's pages."""

import numpy as np
import pytest
import torch

from icekv.methods.icecache import IceCacheConfig
from icekv.index import DCITree
from icekv.index.placement import place_tokens, place_tokens_reference


def _tree_arrays(n: int, page_size: int, room: int):
    """A built tree's page arrays (copies, with ``room`` spare pages) and its token projections."""
    g = torch.Generator().manual_seed(3)
    u = torch.randn(33, generator=g)
    tree = DCITree(torch.randn(n, 32, generator=g), page_size, IceCacheConfig(), u / u.norm())
    pages = tree.num_pages
    arrays = [np.concatenate([a[:pages].numpy(), np.full((room, *a.shape[1:]), fill, dtype=a.numpy().dtype)])
              for a, fill in ((tree.page_tokens, -1), (tree.page_len, 0), (tree.page_owner, -1), (tree.page_version, 0))]
    return arrays, tree.proj[:n].numpy(), pages


@pytest.mark.parametrize("n, page_size, m", [(600, 16, 64), (40, 4, 30), (1, 16, 5), (200, 1, 20)])
def test_compiled_placement_equals_the_reference(n, page_size, m):
    arrays, proj, pages = _tree_arrays(n, page_size, room=m)
    rng = np.random.default_rng(n)
    owners_now = np.unique(arrays[2][:pages])
    # inserted tokens: existing owners (fills and splits), one owner without pages (a new page)
    owners = np.where(rng.random(m) < 0.9, rng.choice(owners_now, m), n - 1)
    proj = np.concatenate([proj, rng.standard_normal(m).astype(proj.dtype)])  # [n + m]
    tokens = np.arange(n, n + m)
    want = [a.copy() for a in arrays]
    changed_ref, pages_ref = place_tokens_reference(tokens, owners, proj, *want, pages)
    changed, pages_out = place_tokens(tokens, owners, proj, *arrays, pages)
    assert pages_out == pages_ref > pages
    assert changed.tolist() == changed_ref.tolist()
    for got, expected in zip(arrays, want):
        np.testing.assert_array_equal(got, expected)
    placed = arrays[0][:pages_out]  # every token, old and new, in exactly one page
    assert sorted(placed[placed >= 0].tolist()) == list(range(n + m))
    assert (arrays[1][:pages_out] == (placed >= 0).sum(1)).all() and (arrays[1][:pages_out] <= page_size).all()
