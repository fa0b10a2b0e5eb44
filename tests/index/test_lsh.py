"""The compiled SimHash buckets and collision counts against their torch references."""

import pytest
import torch

from icekv.index.lsh import HASH_CHUNK, collision_counts, collision_counts_reference, simhash, simhash_reference
from icekv.methods.magicpig import MagicPIGConfig
from icekv.methods.magicpig import hyperplanes


@pytest.mark.parametrize("shape, bits, tables", [
    ((2, 0, 8), 10, 150),  # no token
    ((1, 1, 8), 1, 1),  # one token, one one-bit table
    ((3, 37, 8), 15, 4),  # the widest bucket an int16 holds
    ((2, HASH_CHUNK + 3, 16), 10, 150),  # a partial last chunk
    ((14, 16), 10, 150),  # a decode query's heads
])
def test_simhash_equals_the_reference(shape, bits, tables):
    planes = hyperplanes(shape[-1], MagicPIGConfig(bits=bits, tables=tables, min_collisions=1))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    if x.numel():
        x.view(-1, shape[-1])[0] = 0.0  # every projection exactly 0: no bit set
    codes = simhash(x, planes, bits)
    assert codes.shape == (*shape[:-1], tables) and codes.dtype == torch.int16
    assert torch.equal(codes, simhash_reference(x, planes, bits))
    if x.numel():
        assert int(codes.view(-1, tables)[0].abs().sum()) == 0


@pytest.mark.parametrize("hkv, group, n, tables", [(2, 7, 0, 150), (1, 1, 1, 1), (3, 3, 257, 20), (2, 7, 1000, 150)])
def test_collision_counts_equal_the_reference(hkv, group, n, tables):
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 4, (hkv, n, tables), generator=gen, dtype=torch.int16)  # few buckets: many collisions
    q_codes = torch.randint(0, 4, (hkv, group, tables), generator=gen, dtype=torch.int16)
    if n:
        codes[0, 0] = q_codes[0, 0]  # one token in the query's bucket in every table
    counts = collision_counts(codes, q_codes)
    assert counts.shape == (hkv, group, n) and counts.dtype == torch.int16
    assert torch.equal(counts, collision_counts_reference(codes, q_codes))
    if n:
        assert int(counts[0, 0, 0]) == tables
