"""Page-locked host memory of exactly the size asked for, for the host page pool.

torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two, so a
17 GiB pool would lock 32 GiB of host memory. This locks a plain host tensor in place instead
(``cudaHostRegister``), and unlocks it when its owner goes away. CUDA-only; where registering
fails, the pool is refused with the reason (torch's allocator would lock up to twice the memory
asked for, which a pool sized for the host's memory does not have).
"""

from __future__ import annotations

import weakref

import torch

from icekv.errors import ConfigError


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, owner: object) -> torch.Tensor:
    """An uninitialised host tensor, page-locked for as long as ``owner`` lives."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return tensor
    cudart = torch.cuda.cudart()
    try:
        failed = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0))  # a cudaError: 0 is success
    except Exception as e:  # an API this torch build lacks
        failed = e
    if failed:
        raise ConfigError(f"cannot page-lock the host page pool: cudaHostRegister of {nbytes / 2**30:,.1f} GiB failed "
                          f"({failed}); lower pool_tokens (torch's pinned allocator would round it up to "
                          f"{_pow2(nbytes) / 2**30:,.0f} GiB)")
    weakref.finalize(owner, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
