"""Rows of the index's score dtype: the page keys and centroids it ranks pages with.

Three formats, one per ``IceCacheConfig.score_dtype``:

- ``float32``: a row is its D values.
- ``bfloat16``: D bf16 values. numpy (and so numba) has no bf16: they cross as int16 bits.
- ``int8``: D int8 values and, in the row's last four bytes, its fp32 scale (value * scale is
  the key; scale = max |key| / 127 per row, so no row clips; NaN marks a row with no key).
  A quarter of fp32's bytes, and self-describing: every compiled loop reads a row as one array.

:func:`encode` and :func:`decode` are the torch side (the specification), :func:`widen` and
:func:`narrow` the same conversions inside numba loops, bit-identical to them (:func:`widen_page`:
a page's rows at once). Each compiles to a plain copy-free path for fp32 rows. :func:`dots` is
what the searches spend their time in: the query heads' products with one row, for int8 without
widening it first (the scale is applied once per product, not once per value: twice as fast,
equal to within fp32 rounding).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

SCALE_BYTES = 4  # int8 rows: the fp32 scale after the values
INT8_MAX = 127


def row_width(dim: int, dtype: torch.dtype) -> int:
    """Entries of a stored row of ``dim`` values."""
    return dim + SCALE_BYTES if dtype == torch.int8 else dim


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> rows [..., row_width(D)] in ``dtype``."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / INT8_MAX  # [..., 1] NaN stays NaN
    values = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp(-INT8_MAX, INT8_MAX)  # [..., D]
    return torch.cat([values.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., W] -> the keys [..., D] in fp32."""
    if rows.dtype != torch.int8:
        return rows.float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :-SCALE_BYTES].float() * scale


def computable(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., W] -> [..., D] in a dtype torch multiplies: fp32 and bf16 as they are, int8 decoded."""
    return decode(rows) if rows.dtype == torch.int8 else rows


def raw(t: torch.Tensor) -> np.ndarray:
    """fp32 and int8 as they are; bf16 as its bits (int16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def widen(row, buf):
    """row [W] of any format, buf [D] fp32 -> the row's keys in fp32: ``row`` itself, or ``buf`` filled."""


def widen_page(rows, buf):
    """rows [P, W] of any format (contiguous), buf [P, D] fp32 -> rows ``dots`` reads: bf16 rows
    widened into ``buf`` in one loop over the page (which the compiler vectorizes better than a
    row at a time); fp32 and int8 rows as they are."""


def dots(qh, row, buf, out):
    """qh [G, D] fp32, row [W] of any format, buf [D] fp32 scratch -> out [G]: each query head's
    product with the row's key (NaN for an int8 row with no key)."""


def narrow(row, out):
    """Write the fp32 row [D] into ``out`` [W]: fp32; bf16 bits rounded to nearest even; int8
    values and scale as :func:`encode` writes them."""


@overload(widen, inline="always")
def _widen(row, buf):
    if row.dtype == types.float32:
        return lambda row, buf: row

    if row.dtype == types.int8:
        def from_int8(row, buf):
            d = buf.shape[0]
            scale = _int8_scale(row, buf)
            for t in range(d):
                buf[t] = np.float32(row[t]) * scale
            return buf
        return from_int8

    def from_bits(row, buf):
        bits = buf.view(np.int32)
        for t in range(row.shape[0]):
            bits[t] = np.int32(row[t]) << 16  # bf16 is the high half of an fp32
        return buf

    return from_bits


@overload(widen_page, inline="always")
def _widen_page(rows, buf):
    if rows.dtype != types.int16:
        return lambda rows, buf: rows

    def flat(rows, buf):
        widen(rows.reshape(-1), buf.reshape(-1))  # one loop over the page's values (both contiguous)
        return buf
    return flat


@overload(dots, inline="always")
def _dots(qh, row, buf, out):
    if row.dtype == types.int8:
        def int8_dots(qh, row, buf, out):
            scale = _int8_scale(row, buf)
            for g in range(qh.shape[0]):
                s = np.float32(0.0)
                for t in range(qh.shape[1]):
                    s += qh[g, t] * np.float32(row[t])
                out[g] = s * scale
        return int8_dots

    def widened_dots(qh, row, buf, out):
        key = widen(row, buf)
        for g in range(qh.shape[0]):
            s = np.float32(0.0)
            for t in range(qh.shape[1]):
                s += qh[g, t] * key[t]
            out[g] = s
    return widened_dots


@njit(cache=True, nogil=True, inline="always")
def _int8_scale(row, buf):
    """The fp32 scale in the last four bytes of an int8 row [D + 4] (buf [D] fp32 scratch)."""
    d = buf.shape[0]
    word = np.int32(0)
    for b in range(SCALE_BYTES):  # little-endian bytes of the fp32 scale
        word |= np.int32(np.uint8(row[d + b])) << (8 * b)
    bits = buf.view(np.int32)
    bits[0] = word
    return buf[0]


@overload(narrow, inline="always")
def _narrow(row, out):
    if out.dtype == types.float32:
        def copy(row, out):
            out[:] = row
        return copy

    if out.dtype == types.int8:
        return lambda row, out: _to_int8(row, out)  # a call, not inlined: numba's SSA pass warns on its branches

    def to_bits(row, out):
        bits = row.view(np.uint32)
        for t in range(row.shape[0]):
            b = bits[t]
            out[t] = np.int16(np.int32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)))
    return to_bits


@njit(cache=True, nogil=True)
def _to_int8(row, out):
    """:func:`narrow` into an int8 row: values and scale as :func:`encode` writes them."""
    d = row.shape[0]
    top = np.float32(0.0)
    for t in range(d):
        a = abs(np.float32(row[t]))
        if not a <= top:  # a NaN wins too
            top = a
    scale = top / np.float32(INT8_MAX)
    top_value = np.float32(INT8_MAX)
    for t in range(d):
        v = np.float32(0.0)  # a zero or NaN row: values 0
        if scale > 0:
            v = min(max(np.rint(np.float32(row[t]) / scale), -top_value), top_value)
        out[t] = np.int8(v)
    word = np.empty(1, dtype=np.float32)
    word[0] = scale
    bits = word.view(np.int32)[0]
    for b in range(SCALE_BYTES):
        out[d + b] = np.int8(np.uint8((bits >> (8 * b)) & 0xFF))
