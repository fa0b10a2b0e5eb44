"""KV²'s levers against the other compressors: accuracy against compression time.

Every kv2 variant of the grid (re-feed share as a multiple of the budget x refinement rounds x KV²+
normalisation, plus the whole-context attend and the SnapKV proxy at one point) and kvzip, snapkv,
keydiff and streaming compress the same prefilled contexts (``icekv eval --compress``'s pipeline:
contexts prefilled once, each variant timed beyond that prefill) and answer the same questions.
Saves results.json, report.md (the eval's table) and sweep.png (accuracy against compression
seconds per budget) under ``--out``.

    .venv/bin/python bench/kv2_sweep.py [--task niah_multikey] [--haystack essays] [--lengths 1000]
        [--samples 10] [--kv-budgets 0.05,0.1] [--chat-template] [--out bench/results/kv2_sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.engine import Engine
from icekv.eval.compression import CompressionEvalConfig, Variant, run_compression_eval
from icekv.eval.report import write_compression_report

BASELINES = ("kvzip", "snapkv", "keydiff", "streaming")


def kv2_grid(rho_scales, rounds, normalize) -> list[Variant]:
    """The grid, plus the two structural levers tried once at the grid's first point."""
    grid = []
    for scale, r, norm in itertools.product(rho_scales, rounds, normalize):
        settings = {"rho_scale": scale, "rounds": r, "normalize": norm}
        grid.append(Variant(f"kv2 x{scale:g} r{r}{' +' if norm else ''}", "kv2", settings))
    first = grid[0].settings
    grid.append(Variant(f"{grid[0].label} attend=context", "kv2", {**first, "attend": "context"}))
    grid.append(Variant(f"{grid[0].label} proxy=snapkv", "kv2", {**first, "proxy": "snapkv"}))
    return grid


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["kv_budget"] for r in records if r["method"] != "full"})
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.5), squeeze=False)
    full = [r for r in records if r["method"] == "full"]
    for ax, budget in zip(axes[0], budgets):
        by_method = defaultdict(list)
        for r in records:
            if r["kv_budget"] == budget:
                by_method[r["method"]].append(r)
        for method, rs in sorted(by_method.items()):
            n = sum(r["n"] for r in rs)
            acc = sum(r["accuracy"] * r["n"] for r in rs) / n
            secs = sum(r["compress_s"] for r in rs) / len(rs)
            kv2 = rs[0]["base_method"] == "kv2"
            ax.scatter([secs], [acc], marker="o" if kv2 else "s", s=30 if kv2 else 60)
            ax.annotate(method, (secs, acc), fontsize=6, xytext=(3, 2), textcoords="offset points")
        if full:
            ax.axhline(sum(r["accuracy"] * r["n"] for r in full) / sum(r["n"] for r in full), color="black",
                       linestyle="--", label="full cache")
        ax.set_xscale("log")
        ax.set_title(f"KV budget {budget:.0%}")
        ax.set_xlabel("compression seconds beyond the prefill (log)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="niah_multikey", help="comma list: niah_single, niah_multikey")
    p.add_argument("--haystack", default="essays")
    p.add_argument("--lengths", default="1000")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--kv-budgets", default="0.05,0.1")
    p.add_argument("--rho-scales", default="1,4,10")
    p.add_argument("--rounds", default="1,2")
    p.add_argument("--normalize", default="0,1")
    p.add_argument("--baselines", default=",".join(BASELINES))
    p.add_argument("--chat-template", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/kv2_sweep"))
    args = p.parse_args()
    variants = kv2_grid([float(x) for x in args.rho_scales.split(",")], [int(x) for x in args.rounds.split(",")],
                        [x == "1" for x in args.normalize.split(",")])
    variants += [Variant(m, m) for m in args.baselines.split(",") if m]
    cfg = CompressionEvalConfig(
        variants=tuple(variants), kv_budgets=tuple(float(b) for b in args.kv_budgets.split(",")),
        tasks=tuple(args.task.split(",")), haystack=args.haystack,
        lengths=tuple(int(n) for n in args.lengths.split(",")), samples=args.samples, questions=args.questions,
        chat_template=args.chat_template)
    engine = Engine(EngineConfig())
    text = Assets().haystack_text(args.haystack)
    t0 = time.perf_counter()
    records = run_compression_eval(engine, cfg, text, lambda done, total, resumed: print(f"{done}/{total} contexts",
                                                                                  file=sys.stderr, flush=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
            "model": str(engine.model_dir), "wall_s": round(time.perf_counter() - t0, 1),
            "variants": {v.label: {"method": v.method, **v.settings} for v in variants}}
    write_compression_report(records, args.out, meta)
    plot(records, args.out / "sweep.png")
    print(f"wrote {args.out}/results.json, report.md, accuracy.png, sweep.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
