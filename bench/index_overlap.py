"""Time to first token with the IceCache index built after prefill vs layer by layer during it.

For each context length, the essays' tokens are prefilled twice per repeat, alternating: once
plainly (the first decode builds every layer's index, then steps), once with the selection given
to prefill (a worker builds each layer's index as soon as prefill has written its region; the
first decode waits only for the rest). Both decode one token under the same selection. Reported:
prefill seconds, seconds the first decode spent on the index (build, or wait), their sum (TTFT).

    .venv/bin/python bench/index_overlap.py [--contexts 4096,16384] [--repeats 1] [--search centroids]
        [--index-threads 1] [--out bench/results/index_overlap]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine


def ttft(engine: Engine, ids: list[int], selection: SelectionConfig, during: bool) -> dict:
    req = engine.prefill(ids, selection=selection if during else None)
    try:
        gen = engine.decode(req, SamplingConfig(max_tokens=2, ignore_eos=True), selection)
    finally:
        engine.release(req)
    build = gen.timings["index_build_s"]
    return {"context": len(ids), "index": "during prefill" if during else "after prefill",
            "prefill_s": req.prefill_s, "index_build_s": build, "ttft_s": req.prefill_s + build}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--search", default="centroids", choices=("walk", "exhaustive", "centroids"))
    ap.add_argument("--index-threads", type=int, default=1, help="threads of the build during prefill")
    ap.add_argument("--out", type=Path, default=Path("bench/results/index_overlap"))
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(EngineConfig(paging=PagingConfig(pool_tokens=max(contexts) + 64),
                                 index_threads=args.index_threads))
    seed = engine.tokenizer.encode(Assets().haystack_text("essays"))[:1024]
    selection = SelectionConfig(policy="icecache", budget=args.budget, icecache=IceCacheConfig(search=args.search))
    records = []
    for length in contexts:
        ids = (seed * -(-length // len(seed)))[:length]
        for _ in range(args.repeats):
            for during in (False, True):  # alternating: a drifting machine slows both alike
                records.append(ttft(engine, ids, selection, during))
                print(json.dumps(records[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
               f"{args.index_threads} index threads")
    (args.out / "results.json").write_text(json.dumps({"machine": machine, "records": records}, indent=1))
    lines = ["# Index built after prefill vs during it", "", f"machine: {machine}; icecache, budget {args.budget}, "
             f"search {args.search}", "", "| context | index | prefill s | index build / wait s | TTFT s |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['index']} | {r['prefill_s']:.2f} | {r['index_build_s']:.2f} | {r['ttft_s']:.2f} |"
              for r in records]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
