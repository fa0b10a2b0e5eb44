"""A baseline checked against its reference implementation: kvpress's presses (NVIDIA's library,
PyPI ``kvpress``) on the contexts and questions of an ``icekv eval`` grid, as the same token ids,
question-aware (the question is inside the prompt the press compresses, so it falls in SnapKV's
observation window), each press keeping ``budget`` tokens of every layer and KV head. The
answers are scored by icekv's own scorer. Run under .venv-kvpress (`bash bench/kvpress_reference.sh`
makes it); resumable (rerun the same command).

    .venv-kvpress/bin/python bench/kvpress_reference.py --model DIR --task niah_single \
        --lengths 3000 --samples 8 --budgets 128,256 --press snapkv --out bench/results/X

Differences from icekv's decode-time policy of the same name, by construction: the press keeps its
budget in every layer (icekv keeps the first ``n_unlimited_layers`` whole) and compresses once at
prefill (icekv attends its selection at each decode step; for SnapKV the selection is the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def press_for(name: str, ratio: float, window: int | None):
    """The kvpress press ``name`` removing ``ratio`` of the prompt's KV (its own defaults otherwise)."""
    from kvpress import SnapKVPress, StreamingLLMPress

    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, **({"window_size": window} if window else {}))
    if name == "streaming":
        return StreamingLLMPress(compression_ratio=ratio)
    raise SystemExit(f"unknown press {name!r}: snapkv | streaming")


def keep_ratio(budget: int, prompt_tokens: int) -> float:
    """kvpress's compression ratio that keeps exactly ``budget`` of ``prompt_tokens`` (it keeps
    int(n * (1 - ratio)))."""
    return max(0.0, 1.0 - (budget + 0.5) / prompt_tokens)


def greedy(model, prompt_ids: list[int], max_tokens: int, press, eos: set[int]) -> list[int]:
    """The prompt prefilled under ``press`` (None: the full cache), then ``max_tokens`` greedy tokens."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt_ids])  # [1, T]
    with torch.inference_mode():
        if press is None:
            logits = model(ids, past_key_values=cache).logits[0, -1]
        else:
            with press(model):
                logits = model(ids, past_key_values=cache).logits[0, -1]
        out, position = [], len(prompt_ids)
        for _ in range(max_tokens):
            token = int(logits.argmax())
            if token in eos:
                break
            out.append(token)
            step = model(torch.tensor([[token]]), past_key_values=cache,
                         cache_position=torch.tensor([position])).logits[0, -1]
            logits, position = step, position + 1
    return out


def until_stop(text: str, stop: tuple[str, ...]) -> str:
    """The answer as icekv's decode returns it: ended before the first stop string."""
    ends = [text.find(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def compare(kvpress_log: Path, icekv_log: Path, policy: str) -> str:
    """A markdown table: per budget, each side's summed scores and where they part (a question's
    score is in 0..1: "both" sums the lower of the two, each "only" what one side scored above)."""
    mine = {}
    for line in icekv_log.read_text().splitlines():
        entry = json.loads(line)
        for run in entry.get("runs", ()):
            mine[(f"{run['task']}/{run['length']}/{run['sample']}", run["policy"], run["budget"])] = run["score"]
    theirs = [json.loads(line) for line in kvpress_log.read_text().splitlines()]
    rows = ["| budget | icekv | kvpress | both right | icekv only | kvpress only |", "|---|---|---|---|---|---|"]
    for budget in sorted({r["budget"] for r in theirs}, key=lambda b: b or 0):
        pairs = [(mine.get((r["context"], policy if budget else "full", budget)), r["score"]) for r in theirs
                 if r["budget"] == budget]
        pairs = [(a, b) for a, b in pairs if a is not None]
        n = len(pairs)
        both, mine_only = sum(min(a, b) for a, b in pairs), sum(max(a - b, 0) for a, b in pairs)
        rows.append(f"| {budget or 'full'} | {sum(a for a, _ in pairs):g}/{n} | {sum(b for _, b in pairs):g}/{n} | "
                    f"{both:g} | {mine_only:g} | {sum(max(b - a, 0) for a, b in pairs):g} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--task", default="niah_single")
    ap.add_argument("--lengths", default="3000")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--budgets", default="128,256")
    ap.add_argument("--press", default="snapkv", help="snapkv | streaming")
    ap.add_argument("--window", type=int, default=None, help="SnapKV's observation window (default: kvpress's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", metavar="ICEKV_EVAL_DIR", help="only compare --out's runs with an icekv eval's")
    args = ap.parse_args(argv)
    if args.compare:
        table = compare(Path(args.out) / "runs.jsonl", Path(args.compare) / "runs.jsonl", args.press)
        (Path(args.out) / "comparison.md").write_text(table)
        print(table)
        return

    import torch
    from transformers import AutoModelForCausalLM

    from icekv.assets import Assets
    from icekv.eval.runner import EvalConfig, context_prompts
    from icekv.eval.tasks import HaystackSampler, PromptFormat
    from icekv.model import Tokenizer

    torch.manual_seed(0)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    budgets = [int(x) for x in args.budgets.split(",")]
    cfg = EvalConfig(tasks=(args.task,), lengths=lengths, samples=args.samples)
    tokenizer = Tokenizer(args.model)
    sampler = HaystackSampler(Assets().haystack_text(cfg.haystack), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = {model.config.eos_token_id} if isinstance(model.config.eos_token_id, int) else set(model.config.eos_token_id)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = set()
    if log.exists():
        done = {(r["context"], r["budget"]) for r in map(json.loads, log.read_text().splitlines())}
    with log.open("a") as f:
        for task, length, i in cfg.contexts():
            prompts = context_prompts(cfg, sampler, PromptFormat(), tokenizer.encode, task, length, i)
            question = prompts.sample.questions[0]
            prompt = prompts.context_ids + prompts.suffixes[0]
            key = f"{task}/{length}/{i}"
            for budget in [None] + budgets:
                if (key, budget) in done:
                    continue
                press = None if budget is None else press_for(args.press, keep_ratio(budget, len(prompt)), args.window)
                t0 = time.perf_counter()
                tokens = greedy(model, prompt, prompts.max_tokens[0], press, eos)
                text = until_stop(tokenizer.decode(tokens), question.stop)
                row = {"context": key, "press": args.press if budget else "full", "budget": budget,
                       "window": args.window, "prompt_tokens": len(prompt), "output": text,
                       "expected": list(question.answers), "score": question.score(text),
                       "wall_s": round(time.perf_counter() - t0, 2)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(key, budget, round(row["score"], 2), repr(text), file=sys.stderr)
    summarize(log, out / "summary.json", " ".join(sys.argv))


def summarize(log: Path, path: Path, command: str) -> None:
    """Accuracy per (press, budget) over the log's questions."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    cells: dict[str, list[float]] = {}
    for r in rows:
        cells.setdefault(f"{r['press']}@{r['budget']}", []).append(r["score"])
    summary = {name: {"accuracy": sum(s) / len(s), "n": len(s)} for name, s in cells.items()}
    path.write_text(json.dumps({"command": command, "cells": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
