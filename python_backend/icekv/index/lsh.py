"""SimHash buckets and their collisions with a query, compiled (numba), for MagicPIG's tables.

A token's bucket in table ``j`` is the ``bits`` signs of its (centred) key on hyperplanes
``j*bits .. j*bits + bits - 1``, read as an integer; a query collides with a token in every table
where their buckets are equal. Both are a pass over a few hundred small integers per token: in
torch that is a chain of full-size temporaries per call (a float, a bool and an int32 copy of the
projections; a bool copy of every table of every token per query head); here each is one pass
that reads a token's row once. The ``*_reference`` functions are the plain-torch specification
they are tested against.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

HASH_CHUNK = 4096  # tokens projected at once: bounds the float projections held while hashing


def simhash(x: torch.Tensor, planes: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., D] -> bucket per table [..., tables] int16 (planes [D, tables * bits])."""
    flat = x.reshape(-1, x.shape[-1]).float()  # [N, D]
    codes = torch.empty(flat.shape[0], planes.shape[1] // bits, dtype=torch.int16)  # [N, L]
    for a in range(0, flat.shape[0], HASH_CHUNK):
        projections = flat[a : a + HASH_CHUNK] @ planes  # [n, L*K]
        _pack_signs(projections.numpy(), bits, codes[a : a + HASH_CHUNK].numpy())
    return codes.view(*x.shape[:-1], codes.shape[1])


def simhash_reference(x: torch.Tensor, planes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`simhash` in torch: bit ``i`` of table ``j``'s bucket is the sign of x on hyperplane
    ``j*bits + i``."""
    signs = (x.float() @ planes > 0).view(*x.shape[:-1], planes.shape[1] // bits, bits)  # [..., L, K]
    weights = 2 ** torch.arange(bits, dtype=torch.int32)
    return (signs.to(torch.int32) * weights).sum(-1).to(torch.int16)


def collision_counts(codes: torch.Tensor, q_codes: torch.Tensor) -> torch.Tensor:
    """codes [Hkv, n, L] int16 of the tokens, q_codes [Hkv, G, L] int16 of the query heads (G per
    KV head) -> [Hkv, G, n] int16: in how many tables each query head shares each token's bucket."""
    hkv, n, _ = codes.shape
    out = torch.empty(hkv, q_codes.shape[1], n, dtype=torch.int16)  # [Hkv, G, n]
    _count(codes.contiguous().numpy(), q_codes.contiguous().numpy(), out.numpy())
    return out


def collision_counts_reference(codes: torch.Tensor, q_codes: torch.Tensor) -> torch.Tensor:
    """:func:`collision_counts` in torch."""
    return (codes[:, None] == q_codes[:, :, None]).sum(-1, dtype=torch.int16)  # [Hkv, G, n]


@numba.njit(cache=True, nogil=True, parallel=True)
def _pack_signs(projections, bits, out):
    """projections [n, L*K] -> out [n, L]: each table's sign bits, the first the lowest."""
    n, tables = out.shape
    for t in numba.prange(n):
        for j in range(tables):
            code = 0
            for i in range(bits):
                if projections[t, j * bits + i] > 0:
                    code |= 1 << i
            out[t, j] = code


_TOKEN_BLOCK = 256  # tokens per parallel task


@numba.njit(cache=True, nogil=True, parallel=True)
def _count(codes, q_codes, out):
    """codes [Hkv, n, L], q_codes [Hkv, G, L] -> out [Hkv, G, n]; a token's row is read once for
    all its KV head's query heads."""
    hkv, n, tables = codes.shape
    groups = q_codes.shape[1]
    blocks = -(-n // _TOKEN_BLOCK)
    for task in numba.prange(hkv * blocks):
        h, lo = task // blocks, (task % blocks) * _TOKEN_BLOCK
        for t in range(lo, min(lo + _TOKEN_BLOCK, n)):
            row = codes[h, t]
            for g in range(groups):
                q = q_codes[h, g]
                same = 0
                for j in range(tables):
                    same += row[j] == q[j]
                out[h, g, t] = same
