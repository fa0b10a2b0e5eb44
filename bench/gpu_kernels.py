"""Time the decode kernels on a CUDA device against full attention (torch SDPA), Llama-3.1-8B head
shapes (32 query / 8 KV heads, head_dim 128), bf16, one sequence, budget 256 tokens.

Per context it times, as medians of CUDA-event timings after warm-up:
  full_sdpa       torch SDPA of one query over the whole contiguous KV (GQA)
  select_all      page_select over every page of the context (exhaustive scoring: an upper bound)
  select_index    page_select over 1/16 of the pages (the size of an index's upper level)
  sparse_attn     sparse paged attention over the budget's 16 pages (split + merge)
  sparse_attn_1k  the single-launch form (the TensorRT plugin's)
  sparse_attn_int8, sparse_attn_fp8_e4m3
                  sparse_attn over the same pages quantized (kv_dtype int8 / fp8_e4m3: packed rows of
                  codes + a float32 scale per token, decoded inside the kernel)
  scatter         moving 12 pages (the selected ones) from a staging buffer into slots
  sparse_torch    the torch reference of sparse attention, for scale
Each record's ``pages_bytes`` is what each sparse_attn form reads of K and V pages per step (per
layer), its ``pages_gbps`` that over the kernel's time. Random weights and keys: latency does not
depend on values. Writes one json, rewritten after every timing (a run cut short keeps what it
timed). ``--device cpu`` runs the same kernels in triton's interpreter with wall-clock timing and
few repeats: a dry run of this script, whose times mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch


def cpu_time(fn, warmup: int = 1, iters: int = 2) -> float:
    """Median wall seconds of ``fn()`` (the interpreter's dry run)."""
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_time(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median seconds of ``fn()`` on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_context(tokens: int, dev: str, on_timing, hq=32, hkv=8, d=128, page=16, budget=256,
                  dtype=torch.bfloat16) -> dict:
    """Every kernel's median time at ``tokens``; ``on_timing(partial record)`` after each."""
    from icekv.kernels import reference, scatter_pages, select_pages, sparse_decode_attention
    from icekv.kv.quant import KVFormat

    timer = cuda_time if dev == "cuda" else cpu_time
    n_pages = tokens // page
    q = torch.randn(1, hq, d, device=dev, dtype=dtype)
    k_all = torch.randn(1, hkv, tokens, d, device=dev, dtype=dtype)
    v_all = torch.randn_like(k_all)
    k_pages = k_all[0].view(hkv, n_pages, page, d)  # the same keys as pages [Hkv, C, P, D]
    q4 = q.view(1, hq, 1, d)
    full = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k_all, v_all, enable_gqa=True)

    def candidates(n):
        ids = torch.randperm(n_pages, device=dev)[:n].int().expand(1, hkv, n).contiguous()
        return ids, torch.full_like(ids, page)

    all_ids, all_lens = candidates(n_pages)
    idx_ids, idx_lens = candidates(max(n_pages // 16, 1))
    sel_pages = budget // page
    top_k = sel_pages - 4  # 2 sink + 2 window pages come without selection
    slot_k = torch.randn(hkv, sel_pages, page, d, device=dev, dtype=dtype)
    slot_v = torch.randn_like(slot_k)
    slot_ids = torch.arange(sel_pages, device=dev, dtype=torch.int32).expand(1, hkv, sel_pages).contiguous()
    slot_lens = torch.full_like(slot_ids, page)
    quantized = {f"sparse_attn_{f.name}": (f, f.pack(slot_k), f.pack(slot_v))  # [Hkv, S, P, D + 4] int8
                 for f in (KVFormat("int8"), KVFormat("fp8_e4m3"))}
    pages_bytes = {"sparse_attn": slot_k.nbytes + slot_v.nbytes,
                   **{name: pk.nbytes + pv.nbytes for name, (_, pk, pv) in quantized.items()}}
    stage_k = torch.randn(top_k, page, d, device=dev, dtype=dtype)
    stage_v = torch.randn_like(stage_k)
    heads = torch.arange(top_k, device=dev) % hkv
    slots = torch.arange(top_k, device=dev) // hkv

    kernels = {
        "full_sdpa": full,
        "select_all": lambda: select_pages(q, k_pages, all_ids, all_lens, top_k),
        "select_index": lambda: select_pages(q, k_pages, idx_ids, idx_lens, top_k),
        "sparse_attn": lambda: sparse_decode_attention(q, slot_k, slot_v, slot_ids, slot_lens),
        "sparse_attn_1k": lambda: sparse_decode_attention(q, slot_k, slot_v, slot_ids, slot_lens, max_splits=1),
        **{name: functools.partial(sparse_decode_attention, q, pk, pv, slot_ids, slot_lens, kv_format=f)
           for name, (f, pk, pv) in quantized.items()},
        "scatter": lambda: scatter_pages(slot_k, slot_v, stage_k, stage_v, heads, slots),
        "sparse_torch": lambda: reference.sparse_decode_reference(q, slot_k, slot_v, slot_ids, slot_lens),
    }
    seconds = {}
    record = {"context": tokens, "budget": budget, "dtype": str(dtype), "seconds": seconds, "pages_bytes": pages_bytes}
    for name, fn in kernels.items():
        seconds[name] = timer(fn)
        on_timing(record)
    sparse_total = seconds["select_index"] + seconds["sparse_attn"] + seconds["scatter"]
    return {**record, "pages_gbps": {name: n / seconds[name] / 1e9 for name, n in pages_bytes.items()},
            "sparse_total_s": sparse_total, "sparse_vs_full": sparse_total / seconds["full_sdpa"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the kernels in triton's interpreter (a dry run; fp32, times mean nothing)")
    parser.add_argument("--out", type=Path, required=True, help="json file to write")
    args = parser.parse_args()
    if args.device == "cpu":  # before triton is first imported
        os.environ.update(TRITON_INTERPRET="1", ICEKV_KERNELS="triton")
    elif not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device", file=sys.stderr)
        return 2
    import triton

    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "shapes": "Llama-3.1-8B: 32 q / 8 kv heads, head_dim 128"}
    records = []

    def write(partial: dict | None = None) -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows = records + ([partial] if partial else [])
        args.out.write_text(json.dumps({"meta": meta, "records": rows}, indent=2) + "\n")

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # bf16 tl.dot is wrong in the interpreter
    for c in args.contexts.split(","):
        records.append(bench_context(int(c), args.device, write, dtype=dtype))
        write()
    for r in records:
        s = r["seconds"]
        print(f"{r['context']:>7} tokens: full {s['full_sdpa'] * 1e6:8.1f} us | select(index) {s['select_index'] * 1e6:7.1f}"
              f" select(all) {s['select_all'] * 1e6:8.1f} attn {s['sparse_attn'] * 1e6:6.1f} scatter {s['scatter'] * 1e6:6.1f}"
              f" | sparse/full {r['sparse_vs_full']:.2f}")
        print("         pages read per step: " + ", ".join(
            f"{name.removeprefix('sparse_attn').lstrip('_') or r['dtype'].removeprefix('torch.')}"
            f" {n / 2**20:.2f} MiB in {s[name] * 1e6:.1f} us ({r['pages_gbps'][name]:.0f} GB/s)"
            for name, n in r["pages_bytes"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
