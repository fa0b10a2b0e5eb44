"""OpenAI-Triton page scatter: staged host pages into their device slots (one program per page
and block of its elements). Imported only when the kernel runs or is compiled."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_slots"])
def page_scatter_kernel(
    src_k_ptr, src_v_ptr, heads_ptr, slots_ptr,
    n_slots,
    dst_k_ptr, dst_v_ptr,
    PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr,
):
    """dst_k/v [Hkv, S, P, D][heads[i], slots[i]] = src_k/v [n, P, D][i]; grid (n, ceil(P*D/BLOCK))."""
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_ELEMS
    head = tl.load(heads_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    dst = (head * n_slots + slot) * PAGE_ELEMS + offs
    src = i * PAGE_ELEMS + offs
    tl.store(dst_k_ptr + dst, tl.load(src_k_ptr + src, mask=mask), mask=mask)
    tl.store(dst_v_ptr + dst, tl.load(src_v_ptr + src, mask=mask), mask=mask)
