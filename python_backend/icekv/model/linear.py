"""A linear layer whose few-row products read the weight once, at full memory bandwidth, on a CPU.

A decode step multiplies a few rows (one per request) by every weight matrix: the product is bound
by reading the weights from memory. CPU BLAS (MKL) computes ``x @ W.T`` for a few rows by packing
the transposed weight first, and a one-row product as a matrix-vector product: either way it reads
the weight well below what memory delivers. The same product as ``(W @ x.T).T``, with at least two
columns, streams the weight once. ``bench/small_batch_linear.py`` measures both forms.

Many rows (a prefill chunk) are compute-bound, and ``F.linear`` is the faster form there. CUDA and
dtypes other than float32 keep ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STREAMED_ROWS = 64  # at most this many rows take the weight-streaming form


def streams_weight(x: torch.Tensor) -> bool:
    """Whether ``x`` [N, in] is multiplied in the weight-streaming form."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= STREAMED_ROWS


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in], weight [out, in] -> x @ weight.T + bias [N, out], as ``(weight @ x.T).T``."""
    rows = x.shape[0]
    x = x.contiguous()  # so that x.T reaches BLAS as a transposed operand: the fast layout
    if rows == 1:
        x = torch.cat([x, torch.zeros_like(x)])  # [2, in]: two columns take the matrix-matrix kernel
    y = (weight @ x.T).T[:rows].contiguous()  # [N, out]
    return y.add_(bias) if bias is not None else y


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and checkpoint names) with the few-row CPU form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if streams_weight(x):
            return streamed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
