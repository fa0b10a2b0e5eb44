"""One budgeted layer of a decode step, with and without the vLLM plugin, on the same cache: run
under .venv-vllm (`make setup-vllm`).

An attention shape's layer in vLLM's CPU cache (bf16, blocks of 32, random rows written by vLLM's
own cache writer, a shuffled block table) and one decode query. Timed, each the median of --calls
calls: vLLM's kernel (``cpu_attention_with_kv_cache``) over the whole context, and the plugin's
``RequestIndex.attend`` (icecache at --budget: the page search, then the compiled decode through the
block table). The plugin's call is split by a profiled pass into the search's two compiled stages
(centroid candidates, exact rescoring), the decode, and the rest (Python between them). The index
build (the request's first selecting step, per layer) is timed once.

    .venv-vllm/bin/python bench/vllm_layer_cost.py --shape llama-3.2-1b --contexts 16384,32768 [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from icekv.config.selection import SelectionConfig
from icekv.policies import resolve
from icekv.vllm.backend import probe_layout
from icekv.vllm.request_index import BlockRows, RequestIndex

BLOCK, DTYPE = 32, torch.bfloat16
SHAPES = {"qwen2.5-0.5b": (2, 7, 64), "llama-3.2-1b": (8, 4, 64), "smollm2": (3, 3, 64)}  # KV heads, group, head dim
PARTS = {"candidates": "_candidates", "rescoring": "_rescore", "decode": "_block_rows_decode"}


def median_ms(call, calls: int) -> float:
    """The median milliseconds of ``calls`` calls, after one untimed."""
    call()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def one_context(context: int, kv_heads: int, group: int, head_dim: int, budget: int, calls: int) -> dict:
    """vLLM's kernel and the plugin timed on one layer of ``context`` tokens (see the module's text)."""
    g = torch.Generator().manual_seed(0)
    isa = _get_attn_isa(DTYPE, BLOCK, head_dim)
    blocks = -(-context // BLOCK)
    cache = torch.zeros(blocks + 1, kv_heads, BLOCK, 2 * head_dim, dtype=DTYPE)  # [nb, Hkv, bs, 2D]
    key_cache, value_cache = cache.view(blocks + 1, kv_heads, 2 * BLOCK, head_dim).chunk(2, dim=2)
    table = torch.randperm(blocks + 1, generator=g)[:blocks].int()  # [blocks]
    slots = table.long().repeat_interleave(BLOCK)[:context] * BLOCK + torch.arange(context) % BLOCK  # [context]
    for start in range(0, context, 8192):
        part = slots[start:start + 8192]
        k, v = (torch.randn(len(part), kv_heads, head_dim, generator=g).to(DTYPE) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, part, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    q = torch.randn(1, kv_heads * group, head_dim, generator=g).to(DTYPE)  # [1, Hq, D]
    out = torch.empty_like(q)  # [1, Hq, D]
    starts = torch.tensor([0, 1], dtype=torch.int32)  # [2]: the query's rows, one request
    lengths = torch.tensor([context], dtype=torch.int32)  # [1]
    scheduled = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim, seq_lens=lengths,
        dtype=DTYPE, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
        dynamic_causal=None, kv_cache_dtype="auto")
    scale = head_dim**-0.5

    def vllm_kernel():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=lengths, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table[None],
            softcap=0.0, scheduler_metadata=scheduled, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto")

    layout = probe_layout(isa, DTYPE, BLOCK, head_dim)
    plan = resolve(SelectionConfig(policy="icecache", budget=budget))
    small = min(context, 4 * budget)  # an index over the first tokens: numba's compiled code loaded before the timing
    RequestIndex(plan).attend(0, q[0], BlockRows(cache, table, layout), small, scale)
    index = RequestIndex(plan)

    def plugin():
        index.attend(0, q[0], BlockRows(cache, table, layout), context, scale)

    t0 = time.perf_counter()
    plugin()  # builds the layer's index
    build_s = time.perf_counter() - t0
    vllm_ms, plugin_ms = median_ms(vllm_kernel, calls), median_ms(plugin, calls)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        plugin()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, _, own, cumulative, _)
    profiled = sum(v[3] for k, v in stats.items() if k[2] == "attend") / calls * 1e3
    parts = {part: sum(v[3] for k, v in stats.items() if k[2] == name) / calls * 1e3 for part, name in PARTS.items()}
    parts["rest"] = profiled - sum(parts.values())
    return {"context": context, "isa": isa, "vllm_kernel_ms": round(vllm_ms, 3), "plugin_ms": round(plugin_ms, 3),
            "plugin_over_vllm": round(plugin_ms / vllm_ms, 3), "index_build_s": round(build_s, 3),
            "plugin_parts_ms_profiled": {k: round(v, 3) for k, v in parts.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--contexts", default="16384,32768")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kv_heads, group, head_dim = SHAPES[args.shape]
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        rows.append(one_context(context, kv_heads, group, head_dim, args.budget, args.calls))
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": " ".join(["bench/vllm_layer_cost.py", *sys.argv[1:]]), "shape": args.shape,
              "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "budget": args.budget,
              "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
