"""How much of the centroids search's rescoring must cross to the device when it rescores there:
IceCache decoding on real SmolLM2 keys and queries with ``--rescoring device``, counting the
candidate pages whose keys were already on the device (resident from an earlier step at the same
version) against those copied from the host index.

With ``--rescoring host`` the host reads every candidate's keys each step; with ``device`` it
gathers and copies only the pages new to the candidates. The first decode step fills the cache
from empty and is reported apart (``first_step``) from the steps after it (``steady``).
The device is this machine's CPU: which pages are candidates does not depend on where they are
scored (the device search selects exactly what the host's does: tests/kernels/test_device_rescoring.py).

    .venv/bin/python bench/candidate_reuse.py [--lengths 4000,8000] [--steps 32] [--budget 256]
        [--out bench/results/candidate_reuse]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.backends import RequestPages, SparseAttention
from icekv.eval.tasks import HaystackSampler
from icekv.policies import resolve


def counters(selector) -> tuple[int, int, int]:
    """(candidate lookups, hits, bytes copied) over every layer's rescoring cache."""
    caches = selector.device_rescoring.values()
    return tuple(sum(getattr(c, name) for c in caches) for name in ("lookups", "hits", "bytes_moved"))


def measure(engine: Engine, length: int, steps: int, budget: int) -> dict:
    sample = HaystackSampler(Assets().haystack_text("essays"), engine.tokenizer).make("niah_single", length, seed=1)
    ids = engine.tokenizer.encode(sample.prompt)
    plan = resolve(SelectionConfig(policy="icecache", budget=budget,
                                   icecache=IceCacheConfig(centroid_scoring="device", rescoring="device")))
    req = engine.prefill(ids)
    try:
        selector = plan.make_selector()
        backend = SparseAttention(RequestPages(engine.cache, req.seq_id), engine.model.args, plan, selector)
        logits, after_first = req.logits, None
        for step in range(steps):
            logits = engine.model(torch.tensor([int(logits.argmax())]), backend.begin_step(1), backend)[-1]
            backend.end_step()
            if step == 0:
                after_first = counters(selector)
    finally:
        engine.release(req)
    total = counters(selector)
    a = engine.model.args
    page_keys = plan.page_size * a.head_dim  # values per page's keys
    copied_bytes = page_keys * next(iter(selector.device_rescoring.values())).k.element_size()  # per page

    def part(lookups, hits, moved, n_steps):
        layers = len(backend.sparse_layers)
        return {"steps": n_steps, "candidates_per_layer_step": lookups / max(n_steps * layers, 1),  # all KV heads
                "hit_rate": hits / lookups if lookups else 0.0,
                "pages_copied_per_layer_step": moved / copied_bytes / max(n_steps * layers, 1),
                "host_fp32_key_bytes_read_per_step": {"rescoring host": lookups * page_keys * 4 / max(n_steps, 1),
                                                      "rescoring device": moved / copied_bytes * page_keys * 4
                                                      / max(n_steps, 1)}}

    steady = [t - f for t, f in zip(total, after_first)]
    return {"prompt_tokens": len(ids), "k_pages": plan.selected_pages,
            "candidates_per_query_head": plan.selection.icecache.candidates(plan.selected_pages),
            "kv_heads": a.num_kv_heads, "query_heads_per_kv_head": a.gqa_group,
            "sparse_layers": len(backend.sparse_layers),
            "first_step": part(*after_first, 1), "steady": part(*steady, steps - 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4000,8000")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench/results/candidate_reuse"))
    args = ap.parse_args()
    engine = Engine(EngineConfig(device="cpu"))
    records = []
    for length in (int(x) for x in args.lengths.split(",")):
        r = measure(engine, length, args.steps, args.budget)
        records.append(r)
        s = r["steady"]
        print(f"{r['prompt_tokens']:>6} tokens: {s['candidates_per_layer_step']:.0f} candidate pages per layer "
              f"and step ({r['kv_heads']} KV heads), "
              f"{s['hit_rate']:.1%} already on the device, {s['pages_copied_per_layer_step']:.1f} pages copied "
              f"(first step: {r['first_step']['pages_copied_per_layer_step']:.0f})", flush=True)
    meta = {"command": "python " + " ".join(sys.argv), "model": engine.model_id,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "candidate_reuse.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
