"""OpenAI-Triton page selection: score candidate pages by their best q.k (fused max over the GQA
group and the page's tokens), then keep the top k per (sequence, KV head).

Imported only when a kernel runs or is compiled. Parameter order: inputs, int32 scalars, outputs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from icekv.kernels.group_queries import load_group_queries


@triton.jit
def _page_score(q, k_ptr, head_base, slot, length, g_mask,
                HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr):
    """Best q.k of one page (scalar fp32, -inf when it has no valid token); q [BG, D]."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_DIM)
    length = tl.where(slot >= 0, tl.minimum(length, PAGE_SIZE), 0)
    tok_mask = offs_p < length
    off = head_base + tl.maximum(slot, 0).to(tl.int64) * PAGE_SIZE * HEAD_DIM \
        + offs_p[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(k_ptr + off, mask=tok_mask[:, None], other=0.0)  # [BP, D]
    s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BG, BP]
    s = tl.where(g_mask[:, None] & tok_mask[None, :], s, float("-inf"))
    return tl.max(tl.max(s, 1), 0)


@triton.jit
def _score_candidates(q_ptr, k_ptr, ids_ptr, lens_ptr, scores_ptr, n_cand, n_slots, first, last,
                      NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    """Scores of candidates [first, last) of this program's (sequence, KV head) row."""
    pid = tl.program_id(0)
    h = pid % NUM_KV_HEADS
    q, _, g_mask = load_group_queries(q_ptr, pid, GROUP, HEAD_DIM, BLOCK_G)  # [BG, D], -, [BG]
    row_base = pid.to(tl.int64) * n_cand
    head_base = h.to(tl.int64) * n_slots * PAGE_SIZE * HEAD_DIM
    for j in range(first, last):
        slot = tl.load(ids_ptr + row_base + j)
        length = tl.load(lens_ptr + row_base + j)
        score = _page_score(q, k_ptr, head_base, slot, length, g_mask, HEAD_DIM, PAGE_SIZE, BLOCK_P)
        tl.store(scores_ptr + row_base + j, score)


@triton.jit
def _topk_row(scores_ptr, ids_ptr, lens_ptr, row_base, n_cand, k, out_ids_ptr, out_lens_ptr, out_base,
              BLOCK_C: tl.constexpr):
    """k rounds of arg-max over one row held in registers (ties: lowest index, like a stable sort);
    writes each winner's id and valid length (-1 and 0 once the row has no finite score left)."""
    offs_c = tl.arange(0, BLOCK_C)
    x = tl.load(scores_ptr + row_base + offs_c, mask=offs_c < n_cand, other=float("-inf"))  # [BC]
    for i in range(k):
        best = tl.max(x, 0)
        idx = tl.min(tl.where(x == best, offs_c, BLOCK_C), 0)  # first index holding the max
        found = best > float("-inf")
        at = row_base + tl.minimum(idx, n_cand - 1)
        tl.store(out_ids_ptr + out_base + i, tl.where(found, tl.load(ids_ptr + at), -1))
        tl.store(out_lens_ptr + out_base + i, tl.where(found, tl.load(lens_ptr + at), 0))
        x = tl.where(offs_c == idx, float("-inf"), x)


@triton.jit(do_not_specialize=["n_cand", "n_slots"])  # lengths: one compile whatever their value
def page_score_kernel(
    q_ptr, k_ptr, ids_ptr, lens_ptr,
    n_cand, n_slots,
    scores_ptr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, PAGES_PER_PROGRAM: tl.constexpr,
):
    """Grid (B * Hkv, ceil(C / PAGES_PER_PROGRAM)): scores [B, Hkv, C] fp32."""
    first = tl.program_id(1) * PAGES_PER_PROGRAM
    _score_candidates(q_ptr, k_ptr, ids_ptr, lens_ptr, scores_ptr, n_cand, n_slots, first,
                      tl.minimum(first + PAGES_PER_PROGRAM, n_cand), NUM_KV_HEADS, GROUP, HEAD_DIM,
                      PAGE_SIZE, BLOCK_G, BLOCK_P)


@triton.jit(do_not_specialize=["n_cand", "k"])
def topk_kernel(
    scores_ptr, ids_ptr, lens_ptr,
    n_cand, k,
    out_ids_ptr, out_lens_ptr,
    BLOCK_C: tl.constexpr,
):
    """Grid (B * Hkv,): ids and lens [B, Hkv, k] int32 of the best candidates, best first."""
    row = tl.program_id(0).to(tl.int64)
    _topk_row(scores_ptr, ids_ptr, lens_ptr, row * n_cand, n_cand, k, out_ids_ptr, out_lens_ptr, row * k, BLOCK_C)


@triton.jit(do_not_specialize=["n_cand", "n_slots", "k"])
def page_select_kernel(
    q_ptr, k_ptr, ids_ptr, lens_ptr,
    n_cand, n_slots, k,
    out_ids_ptr, out_lens_ptr, scores_ptr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Scoring and top-k in one launch, grid (B * Hkv,) - the TensorRT plugin's single kernel.
    Each program scores its own row, waits for the whole block, then selects from that row."""
    _score_candidates(q_ptr, k_ptr, ids_ptr, lens_ptr, scores_ptr, n_cand, n_slots, 0, n_cand,
                      NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_G, BLOCK_P)
    tl.debug_barrier()  # the row's scores are visible to every thread of the program
    row = tl.program_id(0).to(tl.int64)
    _topk_row(scores_ptr, ids_ptr, lens_ptr, row * n_cand, n_cand, k, out_ids_ptr, out_lens_ptr, row * k, BLOCK_C)
