"""Page-locked host memory of exactly the size asked for, for the host page pool.

torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two, so a
17 GiB pool would lock 32 GiB of host memory. This locks a plain host tensor in place instead
(``cudaHostRegister``), and unlocks it when its owner goes away. CUDA-only; where registering
fails, torch's allocator is used.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger("icekv")


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
        log.warning("icekv: cudaHostRegister of %d bytes failed (%s); pinning through torch instead", nbytes, failed)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(owner, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor
