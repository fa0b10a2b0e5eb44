"""Time per output token of vLLM (its CPU build) with and without icekv's plugin, one request, one
context length: run under .venv-vllm (`make setup-vllm`). Each engine runs in a process of its own,
one after the other; the decode time is (time for 2N + 1 tokens - time for N + 1 tokens) / N, the
median of --repeats, after a warm-up request: both runs prefill from the prefix cache and build the
plugin's index at their first selecting step, so the difference is N decode steps alone (the index
build is timed apart, as the first selecting step's extra time).

    .venv-vllm/bin/python bench/vllm_tpot.py --model DIR --context 4096 --out bench/results/vllm_tpot_X
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_engine(args) -> dict:
    """This process's engine (icekv's settings or none) timed on the context: seconds per token."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    icekv = {"policy": args.policy, "budget": args.budget} if args.policy != "none" else None
    extra = {"worker_cls": "icekv.vllm.worker.IceKVCPUWorker", "additional_config": {"icekv": icekv}} if icekv else {}
    llm = LLM(model=args.model, dtype=args.dtype, block_size=32, max_model_len=args.context + args.tokens + 64,
              enforce_eager=True, enable_prefix_caching=True, **extra)
    text = " ".join(Path(f).read_text() for f in sorted(Path(args.texts).glob("*.txt")))
    ids = llm.get_tokenizer().encode(text)[: args.context]
    prompt = TokensPrompt(prompt_token_ids=ids)

    def run(tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    prefill_s = run(1)  # the prefill, and the prefix cache holds the prompt from here on
    run(args.tokens + 1)  # warm-up
    short, long = [], []
    for _ in range(args.repeats):
        short.append(run(args.tokens + 1))
        long.append(run(2 * args.tokens + 1))
    tpots = [(b - a) / args.tokens for a, b in zip(short, long)]
    tpot = statistics.median(tpots)
    first_s = statistics.median(short) - args.tokens * tpot  # the prompt from the cache, the index, the first steps
    return {"policy": "vllm" if icekv is None else args.policy, "budget": args.budget if icekv else None,
            "tpot_s": tpot, "tpots_s": tpots, "until_decoding_s": first_s, "prefill_s": prefill_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--texts", default=str(Path.home() / ".cache/icekv/texts/essays"))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32, help="timed decode tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # set in a child: its engine ("none": vLLM's)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.policy is not None:
        print(json.dumps(one_engine(args)), flush=True)
        return 0
    records = []
    for policy in ("none", "icecache"):  # plain vLLM first, then the plugin: one engine at a time
        child = [sys.executable, __file__, "--model", args.model, "--texts", args.texts, "--context", str(args.context),
                 "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--dtype", args.dtype,
                 "--budget", str(args.budget), "--policy", policy]
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        records.append(json.loads(lines[0]))
        print(records[-1], flush=True)
    result = {"command": " ".join(["bench/vllm_tpot.py", *sys.argv[1:]]), "context": args.context, "dtype": args.dtype,
              "records": records, "ratio": records[1]["tpot_s"] / records[0]["tpot_s"]}
    print(json.dumps(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
