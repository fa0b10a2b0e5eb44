"""Where a selecting decode's time goes inside the vLLM plugin, per layer, without vLLM: one
request's ``RequestIndex.attend`` (page search, then the compiled decode through the block table) over a
vLLM-layout cache of random rows, an attention shape (default SmolLM2's: 3 KV heads, 3 query heads
each; Qwen2.5-0.5B's: --kv-heads 2 --group 7; head dim 64), blocks of 32, icecache at budget 256.
Prints the mean milliseconds per call and per part.

    .venv/bin/python bench/vllm_request_index_cost.py [--context 4096] [--calls 200] [--kv-heads 3 --group 3]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch

from icekv.config.selection import SelectionConfig
from icekv.policies import resolve
from icekv.vllm.request_index import BlockLayout, BlockRows, RequestIndex

HEAD_DIM, BLOCK = 64, 32
PARTS = {"search": "_search", "attention": "block_rows_decode_cpu"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    blocks = -(-args.context // BLOCK)
    cache = torch.randn(blocks + 4, args.kv_heads, BLOCK, 2 * HEAD_DIM, generator=g)  # [nb, Hkv, bs, 2D]
    table = torch.randperm(blocks + 4, generator=g)[:blocks].int()
    layout, q = BlockLayout.plain(BLOCK, HEAD_DIM), torch.randn(args.kv_heads * args.group, HEAD_DIM, generator=g)
    index = RequestIndex(resolve(SelectionConfig(policy="icecache", budget=args.budget)))
    index.attend(0, q, BlockRows(cache, table, layout), args.context, HEAD_DIM**-0.5)  # the build, and compiles
    t0 = time.perf_counter()
    for _ in range(args.calls):
        index.attend(0, q, BlockRows(cache, table, layout), args.context, HEAD_DIM**-0.5)
    per_call = (time.perf_counter() - t0) / args.calls * 1e3
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        index.attend(0, q, BlockRows(cache, table, layout), args.context, HEAD_DIM**-0.5)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, _, own, cumulative, _)
    parts = {part: sum(v[3] for k, v in stats.items() if k[2] == name) / args.calls * 1e3 for part, name in PARTS.items()}
    print(json.dumps({"command": " ".join(["bench/vllm_request_index_cost.py", *sys.argv[1:]]), "context": args.context,
                      "kv_heads": args.kv_heads, "group": args.group, "budget": args.budget, "ms_per_call": round(per_call, 3),
                      "ms_per_part_profiled": {k: round(v, 3) for k, v in parts.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
