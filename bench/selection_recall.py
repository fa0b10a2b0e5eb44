"""Page-selection recall of the IceCache searches vs the exact top-k pages, on a real model's keys/queries.

For a needle prompt from the essays, prefill with full attention, record every layer's decode
queries for a few steps, build each (layer, KV head) tree over the indexed region and compare each
search's top-k pages (per query head, before the GQA merge) to the exact top-k pages by max q.k:
the DCI-tree walk (the paper's) and the centroids search at several candidate counts (the default
``IceCacheConfig.candidates(k)`` is its floor of 256 up to k = 32 pages, 8k above). Several
budgets share one prefill, and one tree per (layer, KV head) where their indexed regions agree.

    .venv/bin/python bench/selection_recall.py [--model smollm2-135m] [--length 4000] [--budget 256|64,256,1024]
        [--candidates 96,256] [--score-dtypes bfloat16,int8] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.backends import DenseAttention, RequestPages
from icekv.eval.tasks import HaystackSampler
from icekv.index import DCITree
from icekv.policies import PolicyPlan, resolve


class RecordingAttention(DenseAttention):
    """Full attention that keeps each layer's decode queries."""

    def __init__(self, source):
        super().__init__(source)
        self.queries: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer, q, k, v, selection=None):
        self.queries.setdefault(layer, []).append(q[0].clone())  # [Hq, D]
        return super().attend(layer, q, k, v)


def record_decode_queries(engine: Engine, length: int, steps: int):
    """Prefill a ``length``-token needle prompt from the essays and decode ``steps`` greedy tokens
    with full attention: (prompt ids, the prefilled request, the backend holding each layer's queries)."""
    sample = HaystackSampler(Assets().haystack_text("essays"), engine.tokenizer).make("niah_single", length, seed=1)
    ids = engine.tokenizer.encode(sample.prompt)
    req = engine.prefill(ids)
    backend = RecordingAttention(RequestPages(engine.cache, req.seq_id))
    logits = req.logits
    for _ in range(steps):
        logits = engine.model(torch.tensor([int(logits.argmax())]), backend.begin_step(1), backend)[-1]
    return ids, req, backend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a registry name or model folder (default: the engine's)")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget", default="256", help="one budget, or a comma list measured over one prefill")
    ap.add_argument("--candidates", default="96,256", help="centroids search: pages rescored per query head")
    ap.add_argument("--score-dtypes", default="",
                    help="also the centroids search over a copy of the index with its page keys in these score "
                         "dtypes (e.g. bfloat16,int8), per candidate count")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    # the pool holds the prompt and the recorded decode steps (a prompt at the default pool's size too)
    paging = PagingConfig(pool_tokens=max(PagingConfig.pool_tokens,
                                                 args.length + args.steps + 2 * PagingConfig.page_size))
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging))
    ids, req, backend = record_decode_queries(engine, args.length, args.steps)
    cfg = IceCacheConfig()
    u = torch.randn(engine.model.args.head_dim + 1, generator=torch.Generator().manual_seed(cfg.seed))
    u /= u.norm()
    fov = cfg.field_of_view(len(ids))
    narrow = [d for d in args.score_dtypes.split(",") if d]
    budgets = [int(b) for b in args.budget.split(",")]
    plans = {b: resolve(SelectionConfig(policy="icecache", budget=b)) for b in budgets}
    by_budget = {b: measure(engine, req, len(ids), backend, plans[b], cfg, u, fov,
                            [int(x) for x in args.candidates.split(",")], narrow) for b in budgets}
    engine.release(req)
    results = {b: {"k_pages": plans[b].selected_pages, **r} for b, r in by_budget.items()}
    result = {
        "command": "bench/selection_recall.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in ("", None)),
        "prompt_tokens": len(ids), "steps": args.steps, "page_size": SelectionConfig().page_size, "field_of_view": fov,
    }
    if len(budgets) == 1:
        result |= results[budgets[0]]
    else:
        result["budgets"] = {str(b): r for b, r in results.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    model = f"{args.model}_" if args.model else ""
    suffix = "".join(f"_{d}" for d in narrow)
    name = f"selection_recall_{model}{args.length}_b{args.budget.replace(',', '-')}{suffix}.json"
    (args.out / name).write_text(json.dumps(result, indent=1))
    for b, r in results.items():
        print(f"budget {b} ({r['k_pages']} pages):", json.dumps(r["mean_recall"]))
        for search, per_layer in r["per_layer_recall"].items():
            print(f"  {search} per layer:", " ".join(f"{l}:{x:.2f}" for l, x in per_layer.items()))


def measure(engine, req, prompt_tokens: int, backend, plan: PolicyPlan, cfg: IceCacheConfig, u: torch.Tensor, fov: int,
            candidates: list[int], narrow: list[str]) -> dict:
    """Each search's share of the exact top-k pages, per budgeted layer and on average, at ``plan``'s budget."""
    k, p = plan.selected_pages, plan.page_size
    region = (plan.sink_tokens, (prompt_tokens // p - plan.window_pages) * p)
    searches = {"walk": lambda tree, q: tree.page_scores(q, fov)}
    for c in candidates:
        searches[f"centroids_c{c}"] = lambda tree, q, c=c: tree.centroid_page_scores(q, c)
    for dtype in narrow:  # the same searches over an index that holds its page keys in that dtype
        for c in candidates:
            searches[f"centroids_c{c}_{dtype}"] = lambda tree, q, c=c, d=dtype: tree.narrow[d].centroid_page_scores(q, c)
    per_layer = {name: {} for name in searches}
    query_s = dict.fromkeys(searches, 0.0)
    build_s = 0.0
    for layer in plan.sparse_layers(engine.model.args):
        keys, _ = engine.cache.gather_range(layer, req.seq_id, *region)  # [Hkv, n, D]
        qs = torch.stack(backend.queries[layer])  # [steps, Hq, D]
        hits = {name: [] for name in searches}
        for h, head_keys in enumerate(keys):
            t0 = time.perf_counter()
            tree = DCITree(head_keys, p, cfg, u)
            build_s += time.perf_counter() - t0
            tree.narrow = {d: DCITree(head_keys, p, replace(cfg, score_dtype=d), u) for d in narrow}
            toks = tree.page_tokens[: tree.num_pages]
            group = qs.shape[1] // keys.shape[0]
            for q in qs[:, h * group : (h + 1) * group]:  # [G, D]
                exact = (q @ head_keys.T)[:, toks.clamp_min(0)].masked_fill(toks[None] < 0, float("-inf")).amax(-1)
                for name, search in searches.items():
                    t0 = time.perf_counter()
                    got = search(tree, q)  # [G, pages]
                    query_s[name] += time.perf_counter() - t0
                    for g in range(group):
                        a, b = set(got[g].topk(k).indices.tolist()), set(exact[g].topk(k).indices.tolist())
                        hits[name].append(len(a & b) / k)
        for name, h in hits.items():
            per_layer[name][layer] = sum(h) / len(h)
    return {"mean_recall": {name: sum(r.values()) / len(r) for name, r in per_layer.items()},
            "query_s_total": query_s, "tree_build_s_total": build_s, "per_layer_recall": per_layer}


if __name__ == "__main__":
    main()
