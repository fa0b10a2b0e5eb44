"""Ahead-of-time compilation of the kernels to PTX for a named GPU target, with no GPU needed.

A :class:`KernelSpec` fixes everything a compiled kernel cannot change at run time (dtypes and the
constexpr shapes); :func:`compile_kernel` turns it into PTX plus the launch facts a host needs
(the TensorRT plugins embed exactly this). Must run with ``TRITON_INTERPRET`` unset: interpreted
kernels have no compiler form.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from icekv.kernels import launch

TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation of one kernel: runtime parameters' types (in order) and constexprs (None
    for a pointer parameter the specialisation never reads: it is compiled out of the entry)."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, int | float | None]
    num_warps: int = 4


@dataclass(frozen=True)
class CompiledKernel:
    name: str  # the PTX entry point
    ptx: str = field(repr=False)
    arch: int
    num_warps: int
    threads_per_block: int
    shared_mem: int  # dynamic shared memory in bytes, as the launch must request
    ptx_params: int  # entry parameters: the signature's, then triton's scratch pointers
    scratch_bytes: int  # global + profile scratch the kernel needs (0: its trailing pointers go unused)
    signature: dict[str, str]
    constexprs: dict[str, int | float | None]

    def manifest(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "ptx"}


def _ptr(dtype: torch.dtype) -> str:
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"kernels support {', '.join(map(str, TRITON_DTYPES))}, got {dtype}")
    return "*" + TRITON_DTYPES[dtype]


def decode_spec(dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, page_size: int,
                num_splits: int = 1) -> KernelSpec:
    """``sparse_decode_kernel`` over pages in the model dtype (no quantized KV: its scale and code
    table pointers are compiled out, so the entry takes the same parameters as ever); ``num_splits=1``
    writes final outputs (the plugin's form)."""
    cfg = launch.decode_launch(1, num_kv_heads, group, num_splits, page_size, head_dim, max_splits=num_splits)
    out = _ptr(dtype) if num_splits == 1 else "*fp32"
    return KernelSpec(
        "icekv.kernels.sparse_decode", "sparse_decode_kernel",
        {"q_ptr": _ptr(dtype), "k_ptr": _ptr(dtype), "v_ptr": _ptr(dtype), "ids_ptr": "*i32", "lens_ptr": "*i32",
         "n_sel": "i32", "n_slots": "i32", "out_ptr": out, "lse_ptr": "*fp32"},
        {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size,
         "SM_SCALE": head_dim**-0.5, "NUM_SPLITS": num_splits, "BLOCK_G": cfg.block_g, "BLOCK_P": cfg.block_p,
         "QUANT": 0, "ROW": head_dim, "k_words_ptr": None, "v_words_ptr": None, "lut_ptr": None},
        cfg.num_warps,
    )


def merge_spec(dtype: torch.dtype, head_dim: int, num_splits: int) -> KernelSpec:
    return KernelSpec(
        "icekv.kernels.sparse_decode", "merge_splits_kernel",
        {"part_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": _ptr(dtype), "lse_ptr": "*fp32"},
        {"HEAD_DIM": head_dim, "NUM_SPLITS": num_splits, "BLOCK_S": launch.next_pow2(num_splits)},
    )


def select_spec(dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, page_size: int,
                max_candidates: int) -> KernelSpec:
    """``page_select_kernel`` (scoring + top-k in one launch) for up to ``max_candidates`` pages."""
    cfg = launch.select_launch(1, num_kv_heads, group, max_candidates, page_size, head_dim)
    return KernelSpec(
        "icekv.kernels.page_select", "page_select_kernel",
        {"q_ptr": _ptr(dtype), "k_ptr": _ptr(dtype), "ids_ptr": "*i32", "lens_ptr": "*i32",
         "n_cand": "i32", "n_slots": "i32", "k": "i32",
         "out_ids_ptr": "*i32", "out_lens_ptr": "*i32", "scores_ptr": "*fp32"},
        {"NUM_KV_HEADS": num_kv_heads, "GROUP": group, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size,
         "BLOCK_G": cfg.block_g, "BLOCK_P": cfg.block_p, "BLOCK_C": cfg.block_c},
        cfg.num_warps,
    )


def scatter_spec(dtype: torch.dtype, page_size: int, head_dim: int) -> KernelSpec:
    cfg = launch.scatter_launch(1, page_size, head_dim)
    return KernelSpec(
        "icekv.kernels.page_scatter", "page_scatter_kernel",
        {"src_k_ptr": _ptr(dtype), "src_v_ptr": _ptr(dtype), "heads_ptr": "*i32", "slots_ptr": "*i32",
         "n_slots": "i32", "dst_k_ptr": _ptr(dtype), "dst_v_ptr": _ptr(dtype)},
        {"PAGE_ELEMS": page_size * head_dim, "BLOCK": cfg.block},
        cfg.num_warps,
    )


def compile_kernel(spec: KernelSpec, arch: int = 90, warp_size: int = 32) -> CompiledKernel:
    """PTX for ``sm_<arch>`` (compiled on this machine; no GPU or driver is touched)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(spec.module), spec.kernel)
    if not isinstance(fn, JITFunction):
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset (kernels were loaded interpreted)")
    signature = {**spec.signature, **{name: "constexpr" for name in spec.constexprs}}
    source = ASTSource(fn=fn, signature=signature, constexprs=dict(spec.constexprs))
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, warp_size), options={"num_warps": spec.num_warps})
    meta = compiled.metadata
    ptx = compiled.asm["ptx"]
    return CompiledKernel(
        name=meta.name, ptx=ptx, arch=arch, num_warps=meta.num_warps,
        threads_per_block=meta.num_warps * warp_size, shared_mem=meta.shared,
        ptx_params=len(re.findall(rf"\.param [^\n]*\b{meta.name}_param_\d+", ptx)),
        scratch_bytes=meta.global_scratch_size + meta.profile_scratch_size,
        signature=dict(spec.signature), constexprs=dict(spec.constexprs),
    )


def write_artifacts(kernels: dict[str, CompiledKernel], out_dir: str | Path) -> Path:
    """``<key>.ptx`` per kernel plus ``kernels.json`` (everything but the PTX); returns the json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for key, kernel in kernels.items():
        (out / f"{key}.ptx").write_text(kernel.ptx)
    manifest = out / "kernels.json"
    manifest.write_text(json.dumps({key: k.manifest() for key, k in kernels.items()}, indent=2) + "\n")
    return manifest
