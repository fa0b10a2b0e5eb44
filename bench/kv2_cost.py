"""What compression costs as the context grows: seconds and peak memory beyond the prefill.

Per length, one context (the haystack's tokens, tiled where it is shorter; past the model's
trained length its answers would be poor, but the work done is the same) is prefilled once; each
method then scores that prefilled cache and keeps ``--kv-budget`` of it, timed and measured (peak
resident memory growth) beyond the prefill, as ``icekv eval --compress`` measures it. Saves
results.json and report.md under ``--out``.

    .venv/bin/python bench/kv2_cost.py [--lengths 4096,8192,16384,32768] [--kv-budget 0.05]
        [--methods kv2,kvzip,snapkv] [--out bench/results/kv2_cost]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from icekv.assets import Assets
from icekv.compress import resolved_settings
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.devices import huge_pages_setting, use_huge_pages
from icekv.engine import Engine
from icekv.eval.compression import PeakRSS, Variant, compress_prefilled


def tiled_ids(engine: Engine, text: str, length: int) -> list[int]:
    ids = engine.tokenizer.encode(text)
    return (ids * (length // len(ids) + 1))[:length]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument("--kv-budget", type=float, default=0.05)
    p.add_argument("--methods", default="kv2,kvzip,snapkv")
    p.add_argument("--haystack", default="essays")
    p.add_argument("--out", type=Path, default=Path("bench/results/kv2_cost"))
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(",")
    engine = Engine(EngineConfig(paging=PagingConfig(pool_tokens=max(lengths) + 1024)))
    text = Assets().haystack_text(args.haystack)
    records = []
    for length in lengths:
        ids = tiled_ids(engine, text, length)
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            prefilled = engine.prefill(ids)
            prefill_s = time.perf_counter() - t0
        try:
            for method in methods:
                gc.collect()
                (ctx, seconds, growth), = compress_prefilled(engine, prefilled, ids, Variant(method, method),
                                                             (args.kv_budget,)).values()
                records.append({"length": length, "method": method, "settings": resolved_settings(method),
                                "kv_budget": args.kv_budget, "prefill_s": prefill_s,
                                "prefill_memory_growth_bytes": mem.growth, "compress_s": seconds,
                                "peak_memory_growth_bytes": growth, "kv_bytes": ctx.kv_bytes,
                                "full_kv_bytes": ctx.full_bytes})
                print(f"{length} {method}: {seconds:.1f} s beyond a {prefill_s:.1f} s prefill, "
                      f"+{growth / 2**20:.0f} MiB", file=sys.stderr, flush=True)
                del ctx
                write(args.out, records, engine)  # after each method: a long run keeps what it measured
        finally:
            engine.release(prefilled)
    print(f"wrote {args.out}/results.json, report.md")
    return 0


def write(out: Path, records: list[dict], engine: Engine) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {huge_pages_setting()}",
            "model": engine.model_name,
            "dtype": str(engine.cache.pool.dtype)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    by = {(r["length"], r["method"]): r for r in records}
    lines = ["# Compression cost at length", "", "```", meta["command"], "```", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "command"] + [""]
    lines += ["Seconds and peak resident memory growth beyond the context's prefill (shared by the methods); "
              "ratios are to kvzip at the same length.", "",
              "| tokens | method | prefill s | compress s | / kvzip | peak memory growth MiB | / kvzip |",
              "|---|---|---|---|---|---|---|"]
    for r in records:
        zip_ = by.get((r["length"], "kvzip"))
        ratio = lambda key: f"{r[key] / zip_[key]:.2f}" if zip_ and zip_[key] > 0 else "-"
        lines.append(f"| {r['length']} | {r['method']} | {r['prefill_s']:.1f} | {r['compress_s']:.1f} | "
                     f"{ratio('compress_s')} | {r['peak_memory_growth_bytes'] / 2**20:.0f} | "
                     f"{ratio('peak_memory_growth_bytes')} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    use_huge_pages()  # as the CLI and the server run
    raise SystemExit(main())
