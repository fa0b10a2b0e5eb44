"""Kernels for the decode path: OpenAI Triton for GPUs (and a numba twin of the decode attention
for CPUs, :mod:`icekv.kernels.cpu_decode`), each with a plain-torch reference.

triton is imported only when a kernel runs or is compiled; see :mod:`icekv.kernels.dispatch` for
how the backend is chosen and :mod:`icekv.kernels.reference` for the shared data contract.
"""

from icekv.kernels.dispatch import (
    kernel_backend,
    paged_decode_attention,
    scatter_pages,
    select_pages,
    sparse_decode_attention,
)

__all__ = ["kernel_backend", "paged_decode_attention", "scatter_pages", "select_pages", "sparse_decode_attention"]
