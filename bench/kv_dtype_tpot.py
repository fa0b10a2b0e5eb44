"""Single-request time per output token per KV format, in one process: one engine per ``kv_dtype``,
each holding the same synthesized context, their decodes interleaved repeat by repeat (every other
repeat in reverse order) so that the machine's drift falls on every format alike. "vs auto" is the
median of each repeat's ratio to the model-dtype pool's decode of that repeat. ``icekv bench decode
--kv-dtype`` times one format a process, where drift between processes exceeds the effect.

    .venv/bin/python bench/kv_dtype_tpot.py [--model smollm2-135m] [--context 32768]
        [--policies full,icecache] [--kv-dtypes auto,int8,fp8_e4m3] [--repeats 5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.engine.model_dir import resolve_model_dir
from icekv.eval.decode_bench import DecodeBenchConfig, plans_for, synthesize, time_policy


def time_formats(engines: dict[str, Engine], cfg: DecodeBenchConfig, seed_text: str, context: int,
                 progress=lambda line: None) -> dict[tuple[str, str], list[float]]:
    """(kv_dtype, policy) -> each repeat's TPOT in seconds, over one ``context``-token request per engine."""
    requests = {}
    for kv_dtype, engine in engines.items():
        requests[kv_dtype] = synthesize(engine, engine.tokenizer.encode(seed_text)[: cfg.seed_tokens], context)
    tpot: dict[tuple[str, str], list[float]] = {}
    plans = plans_for(cfg)
    try:
        for r in range(cfg.repeats):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for kv_dtype in order:
                for policy in cfg.policies:
                    record = time_policy(engines[kv_dtype], requests[kv_dtype], cfg, plans[policy], None)
                    tpot.setdefault((kv_dtype, policy), []).append(record["tpot_s"])
                    progress(f"repeat {r + 1} {kv_dtype} {policy}: {record['tpot_s'] * 1e3:.1f} ms/token")
    finally:
        for kv_dtype, engine in engines.items():
            engine.release(requests[kv_dtype])
    return tpot


def report(tpot: dict[tuple[str, str], list[float]], context: int, command: str) -> str:
    kv_dtypes = list(dict.fromkeys(k for k, _ in tpot))
    policies = list(dict.fromkeys(p for _, p in tpot))
    repeats = len(next(iter(tpot.values())))
    lines = [f"# Single-request TPOT per KV format, {context} tokens", "", "```", command, "```", "",
             f"One process, one engine per format; median of {repeats} interleaved repeats. 'vs auto' is the "
             "median of each repeat's ratio to the auto pool's decode of that repeat (its range in brackets).", "",
             "| policy | kv_dtype | TPOT ms | vs auto |", "|---|---|---|---|"]
    for policy in policies:
        base = tpot[(kv_dtypes[0], policy)]
        for kv_dtype in kv_dtypes:
            times = tpot[(kv_dtype, policy)]
            ratios = [t / b for t, b in zip(times, base)]
            lines.append(f"| {policy} | {kv_dtype} | {statistics.median(times) * 1e3:.1f} | "
                         f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a known model's name or a model folder")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--policies", default="full,icecache")
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3", help="the first is the baseline")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.context < 2 or args.repeats < 1 or args.steps < 1:
        parser.error("--context must be >= 2, --repeats and --steps >= 1")
    cfg = DecodeBenchConfig(contexts=(args.context,), policies=tuple(args.policies.split(",")), budget=args.budget,
                            steps=args.steps, icecache=IceCacheConfig(search="centroids"), repeats=args.repeats)
    pool = PagingConfig(pool_tokens=args.context + cfg.seed_tokens + cfg.max_tokens + 2 * PagingConfig.page_size)
    model_dir = str(resolve_model_dir(args.model))
    engines = {k: Engine(EngineConfig(model_dir=model_dir, paging=replace(pool, kv_dtype=k)))
               for k in args.kv_dtypes.split(",")}
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    tpot = time_formats(engines, cfg, Assets().haystack_text("essays"), args.context, progress)
    text = report(tpot, args.context, "bench/kv_dtype_tpot.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
