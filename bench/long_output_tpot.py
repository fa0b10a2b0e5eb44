"""Time per output token late in a long output against early in it, measured side by side.

Two engines in one process hold the same synthesized context. One decodes ``--late`` tokens, the
other ``--early``; then their steps alternate one for one (every other pair in reverse order) for
``--pairs`` pairs, so the machine's drift, which on a shared VM exceeds the effect, falls on both
alike. Each decode is a single request under one policy. The report gives both sides' mean and
median step time, the stage split of the paired steps (page search, transfer, attention,
insertion, the rest), and the ratio late / early: of the means, and the pairs' ratios' median and
mean with its 95% interval.

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
from icekv.eval.decode_bench import SPLIT, DecodeBenchConfig, plans_for, stage_split, step_until, synthesize


def measure(engines: dict[str, Engine], positions: dict[str, int], plan, context: int, pairs: int, seed_text: str,
            seed_tokens: int, progress=lambda line: None) -> dict[str, dict]:
    """Per side (``engines`` and ``positions`` share their names): a ``context``-token request decoded
    under ``plan`` to its position, then the sides' paired steps (:func:`paired_steps`). Every
    request is released at the end, whatever happened."""
    requests, seqs = {}, {}
    try:
        for name, engine in engines.items():
            requests[name] = synthesize(engine, engine.tokenizer.encode(seed_text)[:seed_tokens], context)
            sampling = SamplingConfig(max_tokens=positions[name] + pairs + 2, ignore_eos=True)
            seqs[name] = engine.submit_decode(requests[name], sampling, plan)
            t0 = time.perf_counter()
            step_until(engine, seqs[name], positions[name])
            if len(seqs[name].step_s) < positions[name]:
                raise RuntimeError(f"the {name} decode ended at step {len(seqs[name].step_s)}: {seqs[name].error}")
            progress(f"{name}: {positions[name]} tokens decoded in {time.perf_counter() - t0:.0f} s")
        return paired_steps({name: (engines[name], seq) for name, seq in seqs.items()}, pairs)
    finally:
        for name, seq in seqs.items():
            seq.cancel()
            while not seq.done:  # the cancel takes effect at the next step, which frees its pages
                engines[name].step()
        for name, req in requests.items():
            engines[name].release(req)


def paired_steps(sides: dict[str, tuple[Engine, object]], pairs: int) -> dict[str, dict]:
    """Step each side's engine once per pair, every other pair in reverse order: per side, the
    output tokens its paired steps produced (first, last), each step's time and its stage split."""
    before = {name: dict(seq.backend.timings) for name, (_, seq) in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(pairs):
        for name in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            engine, seq = sides[name]
            steps = len(seq.step_s)
            engine.step()
            if len(seq.step_s) != steps + 1:
                raise RuntimeError(f"the {name} decode took no step: {seq.error}")
            times[name].append(seq.step_s[-1])
    out = {}
    for name, (_, seq) in sides.items():
        split = stage_split(before[name], seq.backend.timings, pairs)
        mean = sum(times[name]) / pairs
        # output token n comes from decode step n (the first token from the prefill's logits)
        out[name] = {"tokens": [len(seq.step_s) - pairs + 1, len(seq.step_s)], "step_s": times[name],
                     "tpot_s": mean, "tpot_median_s": statistics.median(times[name]), **split,
                     "other_s": max(mean - sum(split.values()), 0.0)}
    return out


def report(result: dict) -> str:
    early, late = result["sides"]["early"], result["sides"]["late"]
    ratios = [b / a for a, b in zip(early["step_s"], late["step_s"])]
    mean, sem = statistics.mean(ratios), statistics.stdev(ratios) / len(ratios) ** 0.5
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    rows = [f"| {name}: tokens {side['tokens'][0]:,}-{side['tokens'][1]:,} | {side['tpot_s'] * 1e3:.1f} | "
            f"{side['tpot_median_s'] * 1e3:.1f} | " + " | ".join(f"{side[k] * 1e3:.1f}" for k in (*SPLIT, "other_s"))
            + " |" for name, side in (("early", early), ("late", late))]
    return "\n".join([
        f"# Time per token around output token {late['tokens'][0]:,} against {early['tokens'][0]:,}", "",
        "```", result["command"], "```", "",
        f"{result['model']}, a synthesized {result['context']:,}-token context, `{result['policy']}` at budget "
        f"{result['budget']}; {result['pairs']} paired steps; {result['machine']}; commit {result['commit']}, "
        f"{result['date']}. Milliseconds per step (the forward, the index inserts, the sampling).", "",
        "| side, output tokens | mean | median | page search | transfer | attention | insertion | the rest |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"- late / early, the means: {late['tpot_s'] / early['tpot_s']:.3f}x; the pairs' ratios: median "
        f"{statistics.median(ratios):.3f}x (quartiles {q1:.3f}-{q3:.3f}x), mean {mean:.3f}x "
        f"(95% interval {mean - 1.96 * sem:.3f}-{mean + 1.96 * sem:.3f}x).", ""])


def cpu_model() -> str:
    """The processor's name as Linux reports it (else the machine type)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


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
              "budget": args.budget, "pairs": args.pairs, "machine": f"{cpu_model()}, {os.cpu_count()} cores",
              "commit": commit, "date": time.strftime("%Y-%m-%d"), "sides": sides}
    text = report(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(text)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
