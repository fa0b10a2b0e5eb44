"""The greedy tokens of an equivalence set: every policy x budget x prompt length, each request
alone and all of them batched together, and decodes over a KV²-compressed context. Run it on two
checkouts and compare the JSON files (``--compare A.json B.json`` exits 1 on any difference): a
change that claims to keep behaviour must give the same tokens.

    PYTHONPATH=python_backend .venv/bin/python bench/greedy_tokens.py --out /tmp/after.json
    PYTHONPATH=python_backend .venv/bin/python bench/greedy_tokens.py --compare /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from icekv.assets import Assets
from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.methods.icecache import IceCacheConfig
from icekv.policies import policy_names

LENGTHS = (700, 2500)  # prompt tokens: within the larger budget's reach, and well past both
BUDGETS = (128, 512)
CONTEXT_POLICIES = ("full", "icecache")  # the ones that select over a compressed context
SAMPLING = SamplingConfig(max_tokens=16, ignore_eos=True)
CENTROIDS = IceCacheConfig(search="centroids")  # the default search, spelled out
WALK = IceCacheConfig(search="walk")  # the paper's search


def selections() -> list[SelectionConfig]:
    """Every method at each budget with its settings spelled out (so two checkouts whose defaults
    differ still run the same), and IceCache's tree walk too."""
    out = [SelectionConfig(policy="full")]
    out += [SelectionConfig(policy=p, budget=b, icecache=CENTROIDS) for p in policy_names() if p != "full"
            for b in BUDGETS]
    walks = [SelectionConfig(policy=p, budget=b, icecache=WALK) for p in ("icecache", "icecache_r") for b in BUDGETS]
    return out + walks


def name(sel: SelectionConfig) -> str:
    walk = " walk" if sel.icecache.search == "walk" and sel.policy.startswith("icecache") else ""
    return sel.policy if sel.policy == "full" else f"{sel.policy}{walk}@{sel.budget}"


def run(engine: Engine, text: str) -> dict:
    out: dict[str, list[int]] = {}
    for length in LENGTHS:
        ids = engine.tokenizer.encode(text)[:length]
        for sel in selections():
            out[f"alone {length} {name(sel)}"] = engine.generate(ids, SAMPLING, selection=sel).token_ids
        seqs = {name(sel): engine.submit(ids, SAMPLING, selection=sel) for sel in selections()}
        for key, seq in seqs.items():
            out[f"batched {length} {key}"] = engine.run(seq).token_ids
    context_ids = engine.tokenizer.encode(text)[:LENGTHS[-1]]
    context = engine.compress(context_ids, "kv2", 0.1)
    question = engine.tokenizer.encode(" What is this text about? Answer:")
    for policy in CONTEXT_POLICIES:
        sel = SelectionConfig(policy=policy, budget=128, icecache=CENTROIDS)
        out[f"context kv2@0.1 {name(sel)}"] = engine.generate(question, SAMPLING, selection=sel, context=context).token_ids
    return out


def compare(a: str, b: str) -> int:
    before, after = json.load(open(a))["tokens"], json.load(open(b))["tokens"]
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for key in differ:
        print(f"differs: {key}: {before.get(key)} vs {after.get(key)}")
    print(f"{len(before.keys() & after.keys()) - len(differ)} of {len(before.keys() | after.keys())} equal")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the tokens here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    # the batched requests queue behind the first max_active_requests: no time limit on that wait
    engine = Engine(EngineConfig(device="cpu", paging=PagingConfig(pool_tokens=65536),
                                 scheduler=SchedulerConfig(max_queue_wait_s=1e9)))
    t0 = time.perf_counter()
    tokens = run(engine, Assets().haystack_text("essays"))
    record = {"command": " ".join(sys.argv), "wall_s": round(time.perf_counter() - t0, 1), "tokens": tokens}
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
