"""The query heads that share one KV head, as the kernels load them.

Imported only when a kernel runs or is compiled (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_group_queries(q_ptr, pid, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr):
    """The GROUP query heads of (sequence, KV head) ``pid = b * Hkv + h``, rows of q [B * Hq, D]:
    (q [BLOCK_G, D] zero past GROUP, their row numbers [BLOCK_G], the mask of real rows). BLOCK_G
    is GROUP padded for tl.dot; every query head of the group shares each K page load."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    rows = (pid * GROUP + offs_g).to(tl.int64)  # [BG]
    q = tl.load(q_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    return q, rows, g_mask
