"""Rows of the index's score dtype inside numba loops: fp32 as is, bf16 as raw bits.

numpy (and so numba) has no bf16: a bf16 tensor crosses as its int16 bits (:func:`raw`), and
compiled loops widen a row to fp32 to compute with it (:func:`widen`) or round an fp32 row back
(:func:`narrow`, round-to-nearest-even like torch). Each compiles to a plain copy-free path for
fp32 rows.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import types
from numba.extending import overload


def raw(t: torch.Tensor) -> np.ndarray:
    """fp32 as is; bf16 as its bits (int16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def widen(row, buf):
    """row [D] fp32, or bf16 bits -> an fp32 row: ``row`` itself, or ``buf`` [D] filled."""


def narrow(row, out):
    """Write the fp32 row [D] into ``out`` [D]: fp32, or bf16 bits rounded to nearest even."""


@overload(widen, inline="always")
def _widen(row, buf):
    if row.dtype == types.float32:
        return lambda row, buf: row

    def from_bits(row, buf):
        bits = buf.view(np.int32)
        for t in range(row.shape[0]):
            bits[t] = np.int32(row[t]) << 16  # bf16 is the high half of an fp32
        return buf

    return from_bits


@overload(narrow, inline="always")
def _narrow(row, out):
    if out.dtype == types.float32:
        def copy(row, out):
            out[:] = row
        return copy

    def to_bits(row, out):
        bits = row.view(np.uint32)
        for t in range(row.shape[0]):
            b = bits[t]
            out[t] = np.int16(np.int32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)))
    return to_bits
