"""Launch parameters of the kernels, as plain functions: shared by the Python dispatch, the
ahead-of-time compiler and the TensorRT plugins, and testable without triton or a GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_DOT = 16  # tl.dot needs every block dimension >= 16
H200_SMS = 132


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def check_head_dim(head_dim: int) -> None:
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT} for the kernels, got {head_dim}")


def check_page_shapes(q_shape, pages_shape, ids_shape, lens_shape, what: str = "pages",
                      row: int | None = None) -> None:
    """The shape contract every page kernel shares (q [B, Hq, D], pages [Hkv, S, P, W], ids and
    lens [B, Hkv, K]): a readable error instead of a bad launch or a wrong broadcast. ``row`` is
    the stored row width W: D (the default), or D + 4 for packed quantized rows."""
    q_shape, pages_shape, ids_shape, lens_shape = map(tuple, (q_shape, pages_shape, ids_shape, lens_shape))
    if len(q_shape) != 3 or len(pages_shape) != 4:
        raise ValueError(f"{what}: q must be [B, Hq, D] and pages [Hkv, S, P, W], got {q_shape} and {pages_shape}")
    b, hq, d = q_shape
    hkv = pages_shape[0]
    row = d if row is None else row
    if pages_shape[3] != row:
        raise ValueError(f"{what}: pages rows of {pages_shape[3]} elements, expected {row} for head_dim {d}"
                         + (" packed with its scale" if row != d else ""))
    if hq % hkv:
        raise ValueError(f"{what}: {hq} query heads not a multiple of {hkv} KV heads")
    if ids_shape != lens_shape or len(ids_shape) != 3 or ids_shape[:2] != (b, hkv):
        raise ValueError(f"{what}: page ids and lens must both be [B={b}, Hkv={hkv}, K], got {ids_shape} and {lens_shape}")


@dataclass(frozen=True)
class DecodeLaunch:
    """Split-KV (flash-decoding) launch of ``sparse_decode_kernel``: grid = (B * Hkv, num_splits);
    a second ``merge_splits_kernel`` launch over (B * Hq,) combines the splits when num_splits > 1."""

    grid: tuple[int, int]
    num_splits: int
    block_g: int  # query heads of one KV head, padded for tl.dot
    block_p: int  # tokens of one page, padded for tl.dot
    block_s: int  # splits, padded to a power of two for the merge
    num_warps: int


def prev_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for n < 2)."""
    return 1 << max(0, max(n, 1).bit_length() - 1)


def decode_launch(batch: int, num_kv_heads: int, group: int, n_pages: int, page_size: int,
                  head_dim: int, num_sms: int = H200_SMS, max_splits: int | None = None) -> DecodeLaunch:
    """Enough splits along the selected pages to give every SM about two programs, never a split
    without a page; ``max_splits=1`` gives the single-kernel form (the TensorRT plugin's). The
    split count (a compile-time constant of the kernel) is a power of two, so a decode whose page
    count grows step by step compiles at most one variant per power of two (none once the pages
    outnumber the splits the GPU wants), not one per length."""
    check_head_dim(head_dim)
    programs = max(batch * num_kv_heads, 1)
    splits = max(1, min(n_pages, math.ceil(2 * num_sms / programs), 64))
    if max_splits is not None:
        splits = max(1, min(splits, max_splits))
    splits = prev_pow2(splits)
    return DecodeLaunch(
        grid=(programs, splits), num_splits=splits, block_g=max(MIN_DOT, next_pow2(group)),
        block_p=max(MIN_DOT, next_pow2(page_size)), block_s=next_pow2(splits),
        num_warps=4 if head_dim <= 64 else 8,
    )


@dataclass(frozen=True)
class SelectLaunch:
    """``page_score_kernel`` over grid (B * Hkv, ceil(C / pages_per_program)), then ``topk_kernel``
    over (B * Hkv,); ``page_select_kernel`` fuses both over (B * Hkv,) for the TensorRT plugin."""

    score_grid: tuple[int, int]
    topk_grid: tuple[int]
    pages_per_program: int
    block_g: int
    block_p: int
    block_c: int  # every candidate of one row, padded: the top-k works on one register block
    num_warps: int


MAX_CANDIDATES = 1 << 16


def select_launch(batch: int, num_kv_heads: int, group: int, n_candidates: int, page_size: int,
                  head_dim: int, pages_per_program: int = 8) -> SelectLaunch:
    check_head_dim(head_dim)
    if n_candidates > MAX_CANDIDATES:
        raise ValueError(f"at most {MAX_CANDIDATES} candidate pages per head, got {n_candidates}")
    rows = max(batch * num_kv_heads, 1)
    return SelectLaunch(
        score_grid=(rows, max(1, math.ceil(n_candidates / pages_per_program))), topk_grid=(rows,),
        pages_per_program=pages_per_program, block_g=max(MIN_DOT, next_pow2(group)),
        block_p=max(MIN_DOT, next_pow2(page_size)), block_c=next_pow2(max(n_candidates, 1)),
        num_warps=4,
    )


@dataclass(frozen=True)
class ScatterLaunch:
    """``page_scatter_kernel`` over grid (n_pages, ceil(P * D / block))."""

    grid: tuple[int, int]
    block: int
    num_warps: int = 4


def scatter_launch(n_pages: int, page_size: int, head_dim: int, block: int = 1024) -> ScatterLaunch:
    block = min(block, next_pow2(page_size * head_dim))
    return ScatterLaunch(grid=(max(n_pages, 0), math.ceil(page_size * head_dim / block)), block=block)
