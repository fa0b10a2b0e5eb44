"""Attention recall per layer, per (policy, budget), from an eval run's log.

Each probed decode of ``icekv eval`` records, per budgeted layer, the share of the full attention
mass its selection kept. Averaged per layer over every question of the log, this shows where a
policy loses what full attention reads: e.g. IceCache(r)'s follower layers (those that reuse
their group leader's pages) against the same layers searching with their own query in icecache.

    .venv/bin/python bench/layer_recall.py RUNS_JSONL[.gz] [--budget 256] [--policies icecache,icecache_r]
        [--group 3 --first 2] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def read_log(path: Path) -> list[dict]:
    """The finished contexts of an eval log (the first line is its grid)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f.read().splitlines()[1:] if line.strip()]


def layer_recall(entries: list[dict], policy: str, budget: int) -> dict[int, float]:
    """Layer -> mean attention recall over every question decoded under (policy, budget)."""
    per_layer = defaultdict(list)
    for entry in entries:
        for run in entry["runs"]:
            if run["policy"] == policy and run["budget"] == budget:
                for layer, stats in (run.get("layers") or {}).items():
                    per_layer[int(layer)].append(stats["recall"])
    return {layer: sum(v) / len(v) for layer, v in sorted(per_layer.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--policies", default="icecache,icecache_r")
    ap.add_argument("--group", type=int, default=3, help="layer group of the reuse split (IceCache(r))")
    ap.add_argument("--first", type=int, default=2, help="first budgeted layer (the groups start there)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    entries = read_log(args.log)
    policies = args.policies.split(",")
    recall = {p: layer_recall(entries, p, args.budget) for p in policies}
    layers = sorted({layer for r in recall.values() for layer in r})
    if not layers:
        raise SystemExit(f"{args.log}: no probed decode of {policies} at budget {args.budget}")
    lines = [f"attention recall per layer at budget {args.budget}, {len(entries)} contexts of `{args.log}`", "",
             "| layer | role | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    role = lambda layer: "leader" if (layer - args.first) % args.group == 0 else "follower"
    for layer in layers:
        lines.append(f"| {layer} | {role(layer)} | " + " | ".join(f"{recall[p].get(layer, float('nan')):.3f}"
                                                               for p in policies) + " |")
    for name in ("leader", "follower"):
        group = [layer for layer in layers if role(layer) == name]
        means = [sum(recall[p][layer] for layer in group) / len(group) for p in policies]
        lines.append(f"| mean | {name}s | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(f"```\n.venv/bin/python bench/layer_recall.py {args.log} --budget {args.budget} "
                            f"--policies {args.policies}\n```\n\n{text}")


if __name__ == "__main__":
    main()
