"""The CPU decode kernel's time per KV format, in one process: one layer's full paged decode of one
request (SmolLM2's shape by default: 9 query heads, 3 KV heads, head_dim 64) over a pool in the
model dtype (fp32), int8 and fp8 e4m3 rows, the formats interleaved repeat by repeat so that the
machine's drift falls on all of them alike. It isolates what a quantized pool's decoding costs
from the rest of a decode step (which ``icekv bench decode --kv-dtype`` times, one format a process).

    .venv/bin/python bench/kv_decode_kernel.py [--tokens 32768] [--repeats 40] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from icekv.kernels.cpu_decode import paged_decode_cpu
from icekv.kv.quant import KVFormat

FORMATS = ("auto", "int8", "fp8_e4m3")


def time_formats(tokens: int, repeats: int, hq: int = 9, hkv: int = 3, d: int = 64, page: int = 16) -> dict[str, list[float]]:
    """Format -> each repeat's seconds for one layer's decode of ``tokens`` tokens."""
    g = torch.Generator().manual_seed(0)
    pages = -(-tokens // page)
    values = torch.randn(2, hkv, pages, page, d, generator=g)  # [2, Hkv, pages, P, D]
    q = torch.randn(1, hq, d, generator=g)  # [1, Hq, D]
    ids, starts, lengths = torch.randperm(pages, generator=g), torch.tensor([0]), torch.tensor([tokens])
    runs = {}
    for name in FORMATS:
        fmt = KVFormat(name)
        pool = fmt.pack(values).contiguous()  # [2, Hkv, pages, P, W]
        runs[name] = lambda pool=pool, fmt=fmt: paged_decode_cpu(q, pool, ids, starts, lengths, fmt)
        runs[name]()  # compiled (or loaded from numba's cache) before timing
    seconds = {name: [] for name in FORMATS}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - t0)
    return seconds


def report(seconds: dict[str, list[float]], tokens: int, command: str) -> str:
    base = statistics.median(seconds["auto"])
    lines = [f"# CPU decode kernel per KV format, {tokens} tokens", "", "```", command, "```", "",
             f"torch threads {torch.get_num_threads()}; one layer, one request; median of {len(seconds['auto'])} "
             "interleaved repeats", "", "| kv_dtype | ms | vs auto |", "|---|---|---|"]
    for name, times in seconds.items():
        ms = statistics.median(times)
        lines.append(f"| {name} | {ms * 1000:.2f} | {ms / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1")
    text = report(time_formats(args.tokens, args.repeats), args.tokens, "bench/kv_decode_kernel.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
