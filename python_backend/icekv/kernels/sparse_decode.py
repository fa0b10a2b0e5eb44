"""OpenAI-Triton sparse paged decode attention, split along the selected pages (flash-decoding).

Imported only when a kernel runs or is compiled (it imports triton). Parameters are ordered
inputs, int32 scalars, outputs - the calling convention of TensorRT's AOT plugins. Tensors are
contiguous; see :mod:`icekv.kernels.reference` for the data contract.
"""

from __future__ import annotations

import triton
import triton.language as tl

from icekv.kernels.group_queries import load_group_queries


@triton.jit
def decode_codes(codes, lut_ptr, QUANT: tl.constexpr):
    """Packed rows' codes [.., D] int8 -> their code values, float32 (unscaled): int8 codes are
    their value; fp8 e4m3 bit patterns are looked up in a [256] float32 table by unsigned byte."""
    if QUANT == 1:
        values = codes.to(tl.float32)
    else:
        values = tl.load(lut_ptr + (codes.to(tl.int32) & 255))
    return values


@triton.jit
def load_scales(words_ptr, rows, tok_mask, ROW: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The float32 scale of each token row [BP] of a packed pool, read through its float32 view
    (word ``HEAD_DIM / 4`` of the row); 0 for masked tokens, so padding never reaches the result."""
    return tl.load(words_ptr + rows * (ROW // 4) + HEAD_DIM // 4, mask=tok_mask, other=0.0)


@triton.jit(do_not_specialize=["n_sel", "n_slots"])  # lengths: one compile whatever their value
def sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, k_words_ptr, v_words_ptr, lut_ptr, ids_ptr, lens_ptr,
    n_sel, n_slots,
    out_ptr, lse_ptr,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SM_SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    QUANT: tl.constexpr, ROW: tl.constexpr,
):
    """One program = one (sequence, KV head) and one split of its selected pages; all GROUP query
    heads of the KV head share each K/V page load. Writes the split's normalised output
    out [B, Hq, NUM_SPLITS, D] and log-sum-exp lse [B, Hq, NUM_SPLITS] (final when NUM_SPLITS == 1).

    QUANT = 0: pages in the model dtype, ROW = HEAD_DIM, the words and table pointers unused (None).
    QUANT = 1 (int8) or 2 (fp8 e4m3, decoded through ``lut_ptr``): pages of packed rows of ROW =
    HEAD_DIM + 4 int8 (:mod:`icekv.kv.quant`), ``k/v_words_ptr`` the same pages as float32 words.
    The codes enter the dots in q's dtype (exact for both formats) and the per-token scales are
    applied to the scores (K) and to the probabilities (V), so no page is ever dequantized."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    h = pid % NUM_KV_HEADS
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, HEAD_DIM)
    q, q_rows, g_mask = load_group_queries(q_ptr, pid, GROUP, HEAD_DIM, BLOCK_G)  # [BG, D], [BG], [BG]

    per_split = tl.cdiv(n_sel, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, n_sel)
    sel_base = pid.to(tl.int64) * n_sel  # this (sequence, KV head)'s selection row
    first_slot = h.to(tl.int64) * n_slots  # this KV head's slot 0 in the pool
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for j in range(start, end):
        slot = tl.load(ids_ptr + sel_base + j)
        length = tl.where(slot >= 0, tl.minimum(tl.load(lens_ptr + sel_base + j), PAGE_SIZE), 0)
        tok_mask = offs_p < length  # [BP]
        rows = (first_slot + tl.maximum(slot, 0)) * PAGE_SIZE + offs_p  # [BP] token rows of the pool
        kv_off = rows[:, None] * ROW + offs_d[None, :]  # [BP, D]
        k = tl.load(k_ptr + kv_off, mask=tok_mask[:, None], other=0.0)  # [BP, D] model dtype or codes
        if QUANT != 0:
            k = decode_codes(k, lut_ptr, QUANT).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BG, BP]
        if QUANT != 0:
            s = s * load_scales(k_words_ptr, rows, tok_mask, ROW, HEAD_DIM)[None, :]
        s = s * SM_SCALE
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no token yet: keep exp() finite
        p = tl.exp(s - m_safe[:, None])  # [BG, BP]
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + kv_off, mask=tok_mask[:, None], other=0.0)  # [BP, D]
        pv = p  # [BG, BP] the weights of the value rows
        if QUANT != 0:
            v = decode_codes(v, lut_ptr, QUANT).to(q.dtype)
            pv = p * load_scales(v_words_ptr, rows, tok_mask, ROW, HEAD_DIM)[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision="ieee")
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out_rows = q_rows * NUM_SPLITS + split
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=g_mask[:, None])
    tl.store(lse_ptr + out_rows, tl.where(has, m_i + tl.log(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def merge_splits_kernel(
    part_ptr, part_lse_ptr,
    out_ptr, lse_ptr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program = one (sequence, query head): weight each split's output by its share of the
    softmax mass. part [B*Hq, NUM_SPLITS, D] fp32, part_lse [B*Hq, NUM_SPLITS]."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))  # [BS]
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # [BS]
    total = tl.sum(w, 0)
    parts = tl.load(part_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)  # [BS, D]
    total_safe = tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, tl.sum(parts * w[:, None], 0) / total_safe)
    tl.store(lse_ptr + row, tl.where(total > 0, m_safe + tl.log(total_safe), float("-inf")))
