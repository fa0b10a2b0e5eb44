"""Time per output token late in a long output against early in it, measured side by side.

Two engines in one process hold the same synthesized context. One decodes ``--late`` tokens, the
other ``--early``; then their steps alternate one for one (every other pair in reverse order) for
``--pairs`` pairs, so the machine's drift, which on a shared VM exceeds the effect, falls on both
alike. Each decode is a single request under one policy. The report gives both sides' mean and
median step time, the stage split of the paired steps (page search, transfer, attention,
insertion, the rest), and the ratio late / early: of the means, and the median of the pairs' ratios.

    .venv/bin/python bench/long_output_tpot.py [--model qwen2.5-coder-0.5b] [--context 16384]
        [--early 100] [--late 4000] [--pairs 256] [--policy icecache] [--budget 256] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.engine import Engine
from icekv.engine.model_dir import resolve_model_dir
from icekv.eval.decode_bench import SPLIT, DecodeBenchConfig, plans_for, synthesize


def measure(engines: dict[str, Engine], positions: dict[str, int], plan, context: int, pairs: int, seed_text: str,
            seed_tokens: int, progress=lambda line: None) -> dict[str, dict]:
    """Per side (``engines`` and ``positions`` share their names): a ``context``-token request decoded
    under ``plan`` to its position, then the sides' paired steps (:func:`paired_steps`). Every
    request is released at the end."""
    sides, requests = {}, {}
    try:
        for name, engine in engines.items():
            requests[name] = synthesize(engine, engine.tokenizer.encode(seed_text)[:seed_tokens], context)
            sides[name] = (engine, decode_to(engine, requests[name], plan, positions[name], pairs, progress))
        return paired_steps(sides, pairs)
    finally:
        for name, (engine, seq) in sides.items():
            engine.run(seq)  # its last few tokens: the decode ends and frees its pages
        for name, req in requests.items():
            engines[name].release(req)


def decode_to(engine: Engine, req, plan, position: int, pairs: int, progress):
    """A decode of ``req`` under ``plan`` stepped until it has taken ``position`` steps; room is left
    for ``pairs`` more."""
    seq = engine.submit_decode(req, SamplingConfig(max_tokens=position + pairs + 2, ignore_eos=True), plan)
    t0 = time.perf_counter()
    while len(seq.step_s) < position:
        engine.step()
        if len(seq.step_s) % 500 == 0 and seq.step_s:
            progress(f"step {len(seq.step_s)} of {position}: {seq.step_s[-1] * 1e3:.1f} ms")
    progress(f"decoded {position} tokens in {time.perf_counter() - t0:.0f} s")
    return seq


def paired_steps(sides: dict[str, tuple[Engine, object]], pairs: int) -> dict[str, dict]:
    """Step each side's engine once per pair, alternating which goes first: per side, its output
    position before the pairs, each paired step's time and the stage times over them."""
    before = {name: dict(seq.backend.timings) for name, (_, seq) in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(pairs):
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            engine, seq = sides[name]
            engine.step()
            times[name].append(seq.step_s[-1])
    out = {}
    for name, (_, seq) in sides.items():
        after = seq.backend.timings
        split = {k: (after.get(k, 0.0) - before[name].get(k, 0.0)) / pairs for k in SPLIT}
        mean = sum(times[name]) / pairs
        out[name] = {"position": len(seq.step_s) - pairs, "step_s": times[name], "tpot_s": mean,
                     "tpot_median_s": statistics.median(times[name]), **split,
                     "other_s": max(mean - sum(split.values()), 0.0)}
    return out


def report(result: dict) -> str:
    early, late = result["sides"]["early"], result["sides"]["late"]
    ratios = [b / a for a, b in zip(early["step_s"], late["step_s"])]
    rows = [f"| {name} ({side['position']:,}) | {side['tpot_s'] * 1e3:.1f} | {side['tpot_median_s'] * 1e3:.1f} | "
            + " | ".join(f"{side[k] * 1e3:.1f}" for k in (*SPLIT, "other_s")) + " |"
            for name, side in (("early", early), ("late", late))]
    return "\n".join([
        f"# Time per token at output token {late['position']:,} against {early['position']:,}", "",
        "```", result["command"], "```", "",
        f"{result['model']}, a synthesized {result['context']:,}-token context, `{result['policy']}` at budget "
        f"{result['budget']}; {result['pairs']} paired steps; {result['machine']}; commit {result['commit']}, "
        f"{result['date']}.", "",
        "| side (output position) | mean ms | median ms | page search | transfer | attention | insertion | the rest |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"- late / early, the means: {late['tpot_s'] / early['tpot_s']:.3f}x; the median of the pairs' ratios: "
        f"{statistics.median(ratios):.3f}x (quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-"
        f"{statistics.quantiles(ratios, n=4)[2]:.3f}x).", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a known model's name or a model folder")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--early", type=int, default=100, help="output tokens before the early side's paired steps")
    parser.add_argument("--late", type=int, default=4000, help="output tokens before the late side's paired steps")
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--policy", default="icecache")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.context < 2 or not 1 <= args.early < args.late or args.pairs < 4:
        parser.error("--context must be >= 2, 1 <= --early < --late, --pairs >= 4")
    cfg = DecodeBenchConfig(contexts=(args.context,), policies=(args.policy,), budget=args.budget)
    plan = plans_for(cfg)[args.policy]
    tokens = args.context + cfg.seed_tokens + args.late + args.pairs + 4 * PagingConfig.page_size
    model_dir = str(resolve_model_dir(args.model))
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    engines = {name: Engine(EngineConfig(model_dir=model_dir, paging=PagingConfig(pool_tokens=tokens)))
               for name in ("early", "late")}
    sides = measure(engines, {"early": args.early, "late": args.late}, plan, args.context, args.pairs,
                    Assets().haystack_text("essays"), cfg.seed_tokens, progress)
    command = "bench/long_output_tpot.py " + " ".join(sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": command, "model": Path(model_dir).name, "context": args.context, "policy": args.policy,
              "budget": args.budget, "pairs": args.pairs, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "commit": commit, "date": time.strftime("%Y-%m-%d"), "sides": sides}
    text = report(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
