"""icekv's needle tasks driven through vLLM (its CPU build, with icekv's plugin): the contexts and
questions of an ``icekv eval`` grid, as the same token ids, under vLLM's own attention and under
the plugin at each budget, all in one vLLM engine (a request's policy and budget through
``SamplingParams.extra_args``, the context's blocks shared through vLLM's prefix cache). With
``--compare``, each answer is set beside icekv's own engine's from a saved ``icekv eval`` run of
the same grid. Run under .venv-vllm (`make setup-vllm`); resumable (rerun the same command).

    .venv-vllm/bin/python bench/vllm_needles.py --model DIR --task niah_multikey --questions 8 \
        --num-needles 10 --lengths 16384 --samples 3 --budgets 64,256 --out bench/results/X \
        --compare bench/results/weights_qwen2.5-coder-0.5b_16k_niah_multikey_auto
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path


def plans(budgets: list[int]) -> list[tuple[str, int | None, dict]]:
    """(policy, budget, the request's extra_args): vLLM's own attention, then icecache per budget."""
    return [("full", None, {"policy": "full"})] + [("icecache", b, {"policy": "icecache", "budget": b})
                                                    for b in budgets]


# what makes a grid's prompts and plans: two runs are compared only where these agree
SAME_FIELDS = ("haystack", "questions", "seed", "depths", "max_tokens", "num_needles", "num_values", "num_hops",
               "distinct_key_words", "chat_template", "icecache")


def grid(cfg) -> dict:
    from icekv.eval.run_log import grid_of

    full = grid_of(cfg, ())
    return {name: full[name] for name in SAME_FIELDS}


def read_log(path: Path) -> tuple[dict | None, list[dict]]:
    """A log's config line and its context entries (a line an interrupted write cut short is skipped)."""
    config, entries = None, []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "config" in entry:
            config = entry["config"]
        elif "runs" in entry:
            entries.append(entry)
    return config, entries


def run(args, out: Path) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams, TokensPrompt

    from icekv.assets import Assets
    from icekv.eval.runner import EvalConfig, context_prompts
    from icekv.eval.tasks import HaystackSampler, PromptFormat
    from icekv.model.tokenizer import Tokenizer

    cfg = EvalConfig(tasks=(args.task,), lengths=tuple(args.lengths), samples=args.samples, questions=args.questions,
                     num_needles=args.num_needles, seed=args.seed, policies=("full", "icecache"),
                     budgets=tuple(args.budgets))
    tokenizer = Tokenizer(args.model)
    sampler = HaystackSampler(Assets().haystack_text(cfg.haystack), tokenizer)
    log = out / "runs.jsonl"
    mine = {**grid(cfg), "budgets": list(cfg.budgets), "dtype": args.dtype}
    if log.exists():
        config, entries = read_log(log)
        if config != mine:
            sys.exit(f"{log} holds a run of another grid ({config}): give another --out")
    else:
        log.write_text(json.dumps({"config": mine}) + "\n")
        entries = []
    done = {entry["context"] for entry in entries}
    todo = [(task, length, i) for task, length, i in cfg.contexts() if f"{task}/{length}/{i}" not in done]
    if not todo:
        return
    llm = LLM(model=args.model, dtype=args.dtype, block_size=32, max_model_len=max(cfg.lengths) + 1024,
              enforce_eager=True, enable_prefix_caching=True, worker_cls="icekv.vllm.worker.IceKVCPUWorker",
              additional_config={"icekv": {"policy": "icecache", "budget": max(cfg.budgets)}})
    for task, length, i in todo:
        key = f"{task}/{length}/{i}"
        prompts = context_prompts(cfg, sampler, PromptFormat(), tokenizer.encode, task, length, i)
        runs = []
        for q, question in enumerate(prompts.sample.questions):
            prompt = TokensPrompt(prompt_token_ids=prompts.context_ids + prompts.suffixes[q])
            for policy, budget, xargs in plans(cfg.budgets):
                params = SamplingParams(max_tokens=prompts.max_tokens[q], temperature=0, stop=list(question.stop),
                                        extra_args=xargs)
                text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
                runs.append({"question": q, "policy": policy, "budget": budget, "score": question.score(text),
                             "output": text, "expected": list(question.answers)})
        with open(log, "a") as f:
            f.write(json.dumps({"context": key, "context_tokens": len(prompts.context_ids), "runs": runs}) + "\n")
        print(key, flush=True)


def summarize(args, out: Path) -> dict:
    """Accuracy per (policy, budget) through vLLM, and where a saved icekv run has the same
    question under the same plan, both scores and the questions they differ on."""
    config, mine = read_log(out / "runs.jsonl")
    theirs = {}
    for path in args.compare:
        other, entries = read_log(Path(path) / "runs.jsonl")
        differs = [name for name in SAME_FIELDS if (other or {}).get(name) != config[name]]
        if differs:
            sys.exit(f"--compare {path}: another grid (its {', '.join(differs)} differ)")
        for entry in entries:
            for r in entry["runs"]:
                budget = None if r["policy"] == "full" else r["budget"]
                theirs[(entry["context"], r["question"], r["policy"], budget)] = r["score"]
    table = defaultdict(lambda: {"questions": 0, "vllm": 0.0, "icekv": 0.0, "compared": 0, "differ": []})
    for entry in mine:
        for r in entry["runs"]:
            row = table[f"{r['policy']}@{r['budget']}" if r["budget"] else r["policy"]]
            row["questions"] += 1
            row["vllm"] += r["score"]
            other = theirs.get((entry["context"], r["question"], r["policy"], r["budget"]))
            if other is not None:
                row["compared"] += 1
                row["icekv"] += other
                if other != r["score"]:
                    row["differ"].append(f"{entry['context']}#{r['question']}")
    return {"command": " ".join(["bench/vllm_needles.py", *sys.argv[1:]]), "dtype": args.dtype, "plans": dict(table)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="niah_multikey")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[16384])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--num-needles", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (float32: icekv eval's default)")
    parser.add_argument("--compare", nargs="*", default=[], help="saved `icekv eval` runs of the same grid")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run(args, args.out)
    result = summarize(args, args.out)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["plans"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
