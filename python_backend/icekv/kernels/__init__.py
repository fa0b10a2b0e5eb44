"""GPU kernels (OpenAI Triton) for the decode path, each with a plain-torch reference.

triton is imported only when a kernel runs or is compiled; see :mod:`icekv.kernels.dispatch` for
how the backend is chosen and :mod:`icekv.kernels.reference` for the shared data contract.
"""

from icekv.kernels.dispatch import (
    kernel_backend,
    scatter_pages,
    select_pages,
    sparse_decode_attention,
)

__all__ = ["kernel_backend", "scatter_pages", "select_pages", "sparse_decode_attention"]
