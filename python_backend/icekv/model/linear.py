"""A linear layer whose few-row products read the weight once, at full memory bandwidth, on a CPU.

A decode step multiplies a few rows (one per request) by every weight matrix: the product is bound
by reading the weights from memory. CPU BLAS (MKL, oneDNN) computes ``x @ W.T`` for a few rows by
packing the transposed weight first, and a one-row product as a matrix-vector product: either way
it reads the weight well below what memory delivers. So on a CPU:

- up to ``COMPILED_ROWS`` float32 rows (a decode step of up to that many requests) go through a
  compiled loop that reads each weight row once and multiplies it by every row of ``x``;
- up to ``STREAMED_ROWS`` float32 rows (a short prompt), or bfloat16 ones where the CPU has bf16
  units (:func:`bf16_units`), take ``(W @ x.T).T``, with at least two columns, which BLAS computes
  streaming the weight once (without bf16 units, BLAS reads a bf16 weight faster in ``F.linear``);
- more rows (a prefill chunk) are compute-bound, and ``F.linear`` is the faster form there.

CUDA and other dtypes keep ``F.linear``. ``bench/small_batch_linear.py`` measures the forms.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

COMPILED_ROWS = 8  # at most this many rows take the compiled loop
STREAMED_ROWS = 64  # at most this many rows take the weight-streaming form


def bf16_units(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: CUDA, or a CPU with bf16 instructions
    (AVX512-BF16, AMX-BF16; Arm's BF16 or SVE-BF16). Other CPUs emulate bf16 matmuls, several
    times slower than float32 ones once they are compute-bound."""
    if device.type != "cpu":
        return True
    if not hasattr(torch.cpu, "get_capabilities"):  # torch before 2.10: the x86 units only
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    units = torch.cpu.get_capabilities()
    return any(units.get(unit) for unit in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))


def streams_weight(x: torch.Tensor) -> bool:
    """Whether ``x`` [N, in] is multiplied in one of the forms that read the weight once."""
    streamed_dtype = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and bf16_units(x.device))
    return x.device.type == "cpu" and streamed_dtype and x.dim() == 2 and x.shape[0] <= STREAMED_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] @ weight [out, in].T + bias -> [N, out], in the fastest form for ``x``'s rows."""
    if not streams_weight(x):
        return F.linear(x, weight, bias)
    form = compiled_linear if x.shape[0] <= COMPILED_ROWS and x.dtype == torch.float32 else streamed_linear
    return form(x, weight, bias)


def compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] float32, weight [out, in] (float32 or int8, CPU) -> x @ weight.T + bias [N, out]
    in float32, by :func:`_weight_rows_by_four`."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)  # [N, out]
    _weight_rows_by_four(x.contiguous().numpy(), weight.detach().contiguous().numpy(), out)
    y = torch.from_numpy(out)
    return y.add_(bias) if bias is not None else y


@numba.njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"})
def _weight_rows_by_four(x, w, out):
    """out [M, O] = x [M, K] @ w [O, K].T in float32 (``w`` float32, or int8 codes widened as
    they are read): four weight rows at a time are read from memory once and multiplied by every
    row of x from cache, each row of x in the same loop whatever M is: a row's products are summed
    in one order, so a request's row is the same alone or in a batch."""
    m, k = x.shape
    fours = w.shape[0] - w.shape[0] % 4
    for block in numba.prange(fours // 4):
        j = 4 * block
        w0, w1, w2, w3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        for r in range(m):
            xr = x[r]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(k):
                xi = xr[i]
                a0 += xi * np.float32(w0[i])
                a1 += xi * np.float32(w1[i])
                a2 += xi * np.float32(w2[i])
                a3 += xi * np.float32(w3[i])
            out[r, j], out[r, j + 1], out[r, j + 2], out[r, j + 3] = a0, a1, a2, a3
    for j in range(fours, w.shape[0]):  # the last out % 4 weight rows, one by one
        wj = w[j]
        for r in range(m):
            xr = x[r]
            a = np.float32(0.0)
            for i in range(k):
                a += xr[i] * np.float32(wj[i])
            out[r, j] = a


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in], weight [out, in] -> x @ weight.T + bias [N, out], as ``(weight @ x.T).T``."""
    rows = x.shape[0]
    x = x.contiguous()  # so that x.T reaches BLAS as a transposed operand: the fast layout
    if rows == 1:
        x = torch.cat([x, torch.zeros_like(x)])  # [2, in]: two columns take the matrix-matrix kernel
    y = (weight @ x.T).T[:rows].contiguous()  # [N, out]
    return y.add_(bias) if bias is not None else y


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) with the few-row CPU forms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
