"""The kernels' Python entry points: validate, then run the OpenAI-Triton kernel or the torch
reference. ``auto`` picks the kernels for CUDA tensors when triton imports, the compiled CPU
loops (numba) for CPU tensors, the reference elsewhere; ``ICEKV_KERNELS=triton|numba|torch`` (or
``backend=``) forces one - ``triton`` on CPU tensors runs the kernels in triton's interpreter and
needs ``TRITON_INTERPRET=1`` set before triton loads. Only the sparse decode attention has a numba
twin (:mod:`icekv.kernels.cpu_decode`); the other entry points run the reference under ``numba``."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

import icekv.kernels.launch as launch
import icekv.kernels.reference as reference
from icekv.kv.page_table import PageTable
from icekv.kv.quant import KVFormat, as_words

BACKENDS = ("auto", "triton", "numba", "torch")
ENV_VAR = "ICEKV_KERNELS"


def kernel_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that runs for tensors on ``device``: "triton", "numba" or "torch"."""
    choice = backend or os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"{ENV_VAR} / backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        if device.type == "cpu":
            return "numba"
        return "triton" if device.type == "cuda" and _has_triton() else "torch"
    if choice == "numba" and device.type != "cpu":
        raise RuntimeError(f"{ENV_VAR}=numba runs on CPU tensors only, got {device.type}")
    if choice == "triton":
        if not _has_triton():
            raise RuntimeError(f"{ENV_VAR}=triton but the triton package is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{ENV_VAR}=triton on {device.type} tensors needs TRITON_INTERPRET=1")
    return choice


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_pages(q: torch.Tensor, pages: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor, what: str,
                 kv_format: KVFormat = KVFormat()) -> None:
    try:
        row = kv_format.row_width(q.shape[-1])
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    launch.check_page_shapes(q.shape, pages.shape, ids.shape, lens.shape, what, row=row)
    if kv_format.quantized and pages.dtype != torch.int8:
        raise ValueError(f"{what}: {kv_format.name} pages must hold packed int8 rows, got {pages.dtype}")
    if ids.dtype != torch.int32 or lens.dtype != torch.int32:
        raise ValueError(f"{what}: page ids and lens must be int32, got {ids.dtype} and {lens.dtype}")


QUANT_CODES = {"auto": 0, "int8": 1, "fp8_e4m3": 2}  # sparse_decode_kernel's QUANT per kv_dtype


@functools.lru_cache(maxsize=None)
def _code_table(kv_format: KVFormat, device: torch.device) -> torch.Tensor:
    """The fp8 lookup table [256] fp32 on ``device``, made once rather than copied every step."""
    return kv_format.lut().to(device)


def _kernel_pages(k_pages: torch.Tensor, v_pages: torch.Tensor, kv_format: KVFormat) -> dict:
    """The page arguments of ``sparse_decode_kernel`` for pages stored in ``kv_format``: the pages,
    and when packed their float32 views (the scales) and, for fp8, the code table."""
    k, v = k_pages.contiguous(), v_pages.contiguous()
    if not kv_format.quantized:
        return dict(k_ptr=k, v_ptr=v, k_words_ptr=None, v_words_ptr=None, lut_ptr=None, QUANT=0)
    lut = _code_table(kv_format, k.device) if kv_format.lut() is not None else None
    return dict(k_ptr=k, v_ptr=v, k_words_ptr=as_words(k), v_words_ptr=as_words(v), lut_ptr=lut,
                QUANT=QUANT_CODES[kv_format.name])


def sparse_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            page_ids: torch.Tensor, page_lens: torch.Tensor, sm_scale: float | None = None,
                            backend: str | None = None, max_splits: int | None = None,
                            kv_format: KVFormat = KVFormat()):
    """out [B, Hq, D], lse [B, Hq]: attention over each KV head's named pages (see reference),
    stored in ``kv_format`` (quantized: packed rows [Hkv, S, P, D + 4] int8, decoded in the kernel)."""
    _check_pages(q, k_pages, page_ids, page_lens, "sparse_decode_attention", kv_format)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    if kernel_backend(q.device, backend) != "triton":
        return reference.sparse_decode_reference(q, k_pages, v_pages, page_ids, page_lens, scale, kv_format)
    from icekv.kernels.sparse_decode import merge_splits_kernel, sparse_decode_kernel

    b, hq, d = q.shape
    hkv, n_slots, page_size, row = k_pages.shape
    n_sel = page_ids.shape[2]
    cfg = launch.decode_launch(b, hkv, hq // hkv, n_sel, page_size, d, max_splits=max_splits)
    part_dtype = q.dtype if cfg.num_splits == 1 else torch.float32
    part = torch.empty((b, hq, cfg.num_splits, d), dtype=part_dtype, device=q.device)
    part_lse = torch.empty((b, hq, cfg.num_splits), dtype=torch.float32, device=q.device)
    sparse_decode_kernel[cfg.grid](
        q_ptr=q.contiguous(), **_kernel_pages(k_pages, v_pages, kv_format),
        ids_ptr=page_ids.contiguous(), lens_ptr=page_lens.contiguous(),
        n_sel=n_sel, n_slots=n_slots, out_ptr=part, lse_ptr=part_lse,
        NUM_KV_HEADS=hkv, GROUP=hq // hkv, HEAD_DIM=d, PAGE_SIZE=page_size, SM_SCALE=scale,
        NUM_SPLITS=cfg.num_splits, BLOCK_G=cfg.block_g, BLOCK_P=cfg.block_p, ROW=row, num_warps=cfg.num_warps,
    )
    if cfg.num_splits == 1:
        return part[:, :, 0], part_lse[:, :, 0]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq), dtype=torch.float32, device=q.device)
    merge_splits_kernel[(b * hq,)](part, part_lse, out, lse, HEAD_DIM=d, NUM_SPLITS=cfg.num_splits, BLOCK_S=cfg.block_s)
    return out, lse


def select_pages(q: torch.Tensor, k_pages: torch.Tensor, cand_ids: torch.Tensor, cand_lens: torch.Tensor,
                 k: int, backend: str | None = None, fused: bool = False):
    """Top-``k`` candidate pages per (sequence, KV head) by best q.k: (ids [B, Hkv, k] i32, their
    lens [B, Hkv, k] i32, scores [B, Hkv, C] fp32). ``fused`` runs the single-launch kernel the
    TensorRT plugin uses."""
    _check_pages(q, k_pages, cand_ids, cand_lens, "select_pages")
    if k < 0:
        raise ValueError(f"select_pages: k must be >= 0, got {k}")
    if kernel_backend(q.device, backend) != "triton":
        return reference.page_select_reference(q, k_pages, cand_ids, cand_lens, k)
    from icekv.kernels.page_select import page_score_kernel, page_select_kernel, topk_kernel

    b, hq, d = q.shape
    hkv, n_slots, page_size, _ = k_pages.shape
    n_cand = cand_ids.shape[2]
    cfg = launch.select_launch(b, hkv, hq // hkv, n_cand, page_size, d)
    scores = torch.empty((b, hkv, n_cand), dtype=torch.float32, device=q.device)
    ids = torch.full((b, hkv, k), -1, dtype=torch.int32, device=q.device)
    lens = torch.zeros((b, hkv, k), dtype=torch.int32, device=q.device)
    if n_cand == 0:
        return ids, lens, scores
    args = (q.contiguous(), k_pages.contiguous(), cand_ids.contiguous(), cand_lens.contiguous())
    shapes = dict(NUM_KV_HEADS=hkv, GROUP=hq // hkv, HEAD_DIM=d, PAGE_SIZE=page_size,
                  BLOCK_G=cfg.block_g, BLOCK_P=cfg.block_p)
    if fused:
        page_select_kernel[cfg.topk_grid](*args, n_cand, n_slots, k, ids, lens, scores, BLOCK_C=cfg.block_c,
                                          num_warps=cfg.num_warps, **shapes)
        return ids, lens, scores
    page_score_kernel[cfg.score_grid](*args, n_cand, n_slots, scores, PAGES_PER_PROGRAM=cfg.pages_per_program,
                                      num_warps=cfg.num_warps, **shapes)
    topk_kernel[cfg.topk_grid](scores, args[2], args[3], n_cand, k, ids, lens, BLOCK_C=cfg.block_c,
                               num_warps=cfg.num_warps)
    return ids, lens, scores


def scatter_pages(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                  heads: torch.Tensor, slots: torch.Tensor, backend: str | None = None) -> None:
    """In place: dst_k/v [Hkv, S, P, D][heads[i], slots[i]] = src_k/v [n, P, D][i]."""
    if src_k.shape != src_v.shape or src_k.shape[1:] != dst_k.shape[2:] or dst_k.shape != dst_v.shape:
        raise ValueError(f"scatter_pages: pages {tuple(src_k.shape)} do not fit slots {tuple(dst_k.shape)}")
    if heads.shape != slots.shape or heads.shape != src_k.shape[:1]:
        raise ValueError(f"scatter_pages: heads {tuple(heads.shape)} and slots {tuple(slots.shape)} must be [{src_k.shape[0]}]")
    if kernel_backend(dst_k.device, backend) != "triton" or len(heads) == 0:
        return reference.scatter_pages_reference(dst_k, dst_v, src_k, src_v, heads, slots)
    if not (dst_k.is_contiguous() and dst_v.is_contiguous()):
        raise ValueError("scatter_pages: the slot tensors must be contiguous to be written in place")
    from icekv.kernels.page_scatter import page_scatter_kernel

    hkv, n_slots, page_size, d = dst_k.shape
    cfg = launch.scatter_launch(len(heads), page_size, d)
    page_scatter_kernel[cfg.grid](
        src_k.to(dst_k.dtype).contiguous(), src_v.to(dst_v.dtype).contiguous(),
        heads.to(dst_k.device, torch.int32).contiguous(), slots.to(dst_k.device, torch.int32).contiguous(),
        n_slots, dst_k, dst_v,
        PAGE_ELEMS=page_size * d, BLOCK=cfg.block, num_warps=cfg.num_warps,
    )


def paged_decode_attention(q: torch.Tensor, pool_layer: torch.Tensor, table: PageTable, backend: str | None = None,
                           kv_format: KVFormat = KVFormat(), first_visible: torch.Tensor | None = None) -> torch.Tensor:
    """Full decode attention of a batch of requests (q [B, Hq, D]) over their pages in the pool,
    ``table`` naming request ``b``'s (contract in
    :func:`icekv.kernels.reference.paged_decode_reference`, rows stored in ``kv_format``; in a
    sliding-window layer each request attends from its ``first_visible`` [B] position on): compiled
    on a CPU for fp32 or bf16 queries (over a pool of their dtype or a packed one), the sparse decode
    kernel over every page of each request under triton (the table's per-head form, made once per
    table), the reference elsewhere. The sparse kernel reads each page from its first slot, so a
    sliding-window layer (``first_visible`` given) takes the reference under triton, for every
    request of the batch alike: a request's arithmetic never depends on the others'."""
    from icekv.kernels.cpu_decode import compiled_reads, paged_decode_cpu

    choice = kernel_backend(q.device, backend)
    csr = (table.indices, table.starts, table.lengths)
    if choice == "numba" and compiled_reads(q.dtype, pool_layer.dtype, kv_format):
        return paged_decode_cpu(q, pool_layer, *csr, kv_format, first_visible)
    if choice != "triton" or first_visible is not None:
        return reference.paged_decode_reference(q, pool_layer, *csr, kv_format, first_visible)
    ids, lens = table.per_head(pool_layer.shape[1])
    out, _ = sparse_decode_attention(q, pool_layer[0], pool_layer[1], ids.to(q.device), lens.to(q.device),
                                     backend=choice, kv_format=kv_format)
    return out
