"""A shared document asked many questions through a real tritonserver, three ways: (a) sent whole
each time and prefilled whole (``cache_prompt: false``); (b) sent whole, its pages held by the
prefix cache after the first question (lossless: the same KV); (c) sent as a reusable ``context``
that the server compresses once and reuses (smaller: only the kept share of its KV is held).

One ~3k-token essays context with 20 needles (``niah_multikey``), one question per needle, asked
one after another. Per kv budget, the server's answers over its compressed context are compared
with the CLI path's (the same context compressed in-process by ``Engine.compress``, the same
questions by ``Engine.generate``). Saves json + md under bench/results/context_reuse/.

    .venv/bin/python bench/context_reuse.py [--model smollm2-135m] [--length 3000] [--questions 20]
        [--kv-budgets 0.05,0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.config.serving import CompressionConfig
from icekv.devices import use_huge_pages
from icekv.engine import Engine
from icekv.eval.tasks import HaystackSampler, make_reusable
from icekv.serving.client import Final, stream_generate
from icekv.serving.launcher import TritonServer

STOP = ["\n"]


def ask(url: str, question: str, max_tokens: int, **fields) -> tuple[str, Final, float]:
    t0 = time.perf_counter()
    pieces = list(stream_generate(url, question, max_tokens=max_tokens, stop=STOP, **fields))
    return "".join(p for p in pieces if isinstance(p, str)), pieces[-1], time.perf_counter() - t0


def cli_answers(engine: Engine, context: str, questions, method: str, budget: float, max_tokens: int) -> list[str]:
    """The CLI path: compress in-process, answer each question over the compressed context."""
    compressed = engine.compress(engine.tokenizer.encode(context), method, budget)
    sampling = SamplingConfig(max_tokens=max_tokens, stop=tuple(STOP))
    return [engine.generate(q, sampling, selection=SelectionConfig(policy="full"), context=compressed).text
            for q, _ in questions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=3000, help="context tokens")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--kv-budgets", default="0.05,0.25")
    ap.add_argument("--method", default=CompressionConfig.method)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/context_reuse"))
    args = ap.parse_args()
    assets = Assets()
    model_dir = assets.model_dir(args.model)
    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    sample = make_reusable(HaystackSampler(assets.haystack_text("essays"), engine.tokenizer), args.length,
                           args.seed, args.questions)
    questions = sample.questions
    budgets = [float(b) for b in args.kv_budgets.split(",")]
    runs = []
    with TritonServer({"model_dir": str(model_dir), "policy": "full", "pool_tokens": "16384"}) as server:
        ask(server.grpc_url, "Hello", 2)  # warm-up: first-request costs are not the document's
        for mode, cache_prompt in (("whole document each time", False), ("whole, as a cached prompt prefix", True)):
            whole = [ask(server.grpc_url, sample.context + q, args.max_tokens, cache_prompt=cache_prompt)
                     for q, _ in questions]
            runs.append({"mode": mode, "kv_budget": None, "answers": [a for a, _, _ in whole],
                         "latencies_s": [t for _, _, t in whole], "context_cache": None,
                         "cached_tokens": [f.cached_tokens for _, f, _ in whole]})
        for budget in budgets:
            shared = [ask(server.grpc_url, q, args.max_tokens, context=sample.context, kv_method=args.method,
                          kv_budget=budget) for q, _ in questions]
            runs.append({"mode": "shared context", "kv_budget": budget, "answers": [a for a, _, _ in shared],
                         "latencies_s": [t for _, _, t in shared],
                         "context_cache": [f.context_cache for _, f, _ in shared]})
    for run in runs:
        run["total_s"] = sum(run["latencies_s"])
        run["correct"] = sum(expected in answer for answer, (_, expected) in zip(run["answers"], questions))
        if run["kv_budget"] is not None:
            cli = cli_answers(engine, sample.context, questions, args.method, run["kv_budget"], args.max_tokens)
            run["cli_correct"] = sum(expected in answer for answer, (_, expected) in zip(cli, questions))
            run["same_answers_as_cli"] = sum(a == b for a, b in zip(run["answers"], cli))
    runs[1]["same_answers_as_whole"] = sum(a == b for a, b in zip(runs[0]["answers"], runs[1]["answers"]))
    baseline = runs[0]["total_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "bench/context_reuse.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                      if k != "out"), "model": args.model,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only", "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "method": args.method,
        "context_tokens": sample.context_tokens, "questions": len(questions), "server_policy": "full",
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    md = ["# A shared document, many questions: whole each time vs a reusable context", "",
          f"`{result['command']}` on {result['machine']}, commit {commit}, {result['date']}.", "",
          f"{len(questions)} questions, asked one after another, about one {sample.context_tokens}-token context "
          f"(essays, one needle per question); model {args.model}, server policy full, kv method {args.method}. "
          "Sent whole, the document is prefilled each time (`cache_prompt: false`) or, as a cached prompt prefix, "
          "held by the prefix cache after the first question. A shared-context run's first request compresses the "
          "context; the rest find it in memory.", "",
          "| mode | kv budget | total s | vs whole | mean s per question | first request s | correct | "
          "CLI path correct | answers identical to the CLI path |",
          "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        n = len(run["latencies_s"])
        md.append(f"| {run['mode']} | {run['kv_budget'] if run['kv_budget'] is not None else '-'} | "
                  f"{run['total_s']:.1f} | {run['total_s'] / baseline:.3f}x | {run['total_s'] / n:.2f} | "
                  f"{run['latencies_s'][0]:.1f} | {run['correct']}/{n} | {run.get('cli_correct', '-')}"
                  f"{'/' + str(n) if 'cli_correct' in run else ''} | "
                  f"{str(run['same_answers_as_cli']) + '/' + str(n) if 'same_answers_as_cli' in run else '-'} |")
    md += ["", f"As a cached prompt prefix, {runs[1]['same_answers_as_whole']}/{len(questions)} answers are identical "
           "to the whole document's."]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    use_huge_pages()  # as the CLI and the server run
    main()
