"""A linear layer whose few-row products read the weight once, at full memory bandwidth, on a CPU.

A decode step multiplies a few rows (one per request) by every weight matrix: the product is bound
by reading the weights from memory. CPU BLAS (MKL, oneDNN) computes ``x @ W.T`` for a few rows by
packing the transposed weight first, and a one-row product as a matrix-vector product: either way
it reads the weight well below what memory delivers. So on a CPU:

- up to ``COMPILED_ROWS`` float32 rows (a decode step of up to that many requests) go through a
  compiled loop that reads each weight row once and multiplies it by every row of ``x``;
- up to ``STREAMED_ROWS`` float32 or bfloat16 rows (a short prompt, a bf16 decode step) take
  ``(W @ x.T).T``, with at least two columns, which BLAS computes streaming the weight once;
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


def streams_weight(x: torch.Tensor) -> bool:
    """Whether ``x`` [N, in] is multiplied in one of the forms that read the weight once."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2
            and x.shape[0] <= STREAMED_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] @ weight [out, in].T + bias -> [N, out], in the fastest form for ``x``'s rows."""
    if not streams_weight(x):
        return F.linear(x, weight, bias)
    form = compiled_linear if x.shape[0] <= COMPILED_ROWS and x.dtype == torch.float32 else streamed_linear
    return form(x, weight, bias)


def compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in], weight [out, in] (float32, CPU) -> x @ weight.T + bias [N, out], by
    :func:`_rows_by_four`."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)  # [N, out]
    _rows_by_four(x.contiguous().numpy(), weight.detach().contiguous().numpy(), out)
    y = torch.from_numpy(out)
    return y.add_(bias) if bias is not None else y


@numba.njit(cache=True, nogil=True, parallel=True, fastmath={"reassoc", "contract"})
def _rows_by_four(x, w, out):
    """out [M, O] = x [M, K] @ w [O, K].T: each weight row is read from memory once; its products
    with every row of x come from it in L1, four rows of x at a time, then the rest one by one."""
    m, k = x.shape
    fours = m - m % 4
    for j in numba.prange(w.shape[0]):
        wj = w[j]
        for r in range(0, fours, 4):
            x0, x1, x2, x3 = x[r], x[r + 1], x[r + 2], x[r + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for i in range(k):
                wi = wj[i]
                a0 += x0[i] * wi
                a1 += x1[i] * wi
                a2 += x2[i] * wi
                a3 += x3[i] * wi
            out[r, j], out[r + 1, j], out[r + 2, j], out[r + 3, j] = a0, a1, a2, a3
        for r in range(fours, m):
            xr = x[r]
            a = np.float32(0.0)
            for i in range(k):
                a += xr[i] * wj[i]
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
