"""Time per output token of vLLM (its CPU build) with and without icekv's plugin, one request, one
context length: run under .venv-vllm (`make setup-vllm`). Each engine runs in a process of its own,
one after the other. After the prefill (timed) and a warm-up request, each of --repeats requests
decodes N + 2 tokens from the prefix cache, stepped one engine step at a time: its first two steps
(the prompt's last block, then the first decode step, which builds the plugin's index) are timed
as "until decoding", the median of the N steps after them as its time per token; the figure is
the median over the requests. After each, the conversation's next turn (that prompt, its answer and
the next 100 tokens of text) is timed until decoding the same way: its prefill from the prefix
cache, then a first decode step that continues the index the answer's request released.

    .venv-vllm/bin/python bench/vllm_tpot.py --model DIR --context 4096 --out bench/results/vllm_tpot_X

``--shape llama-3.2-1b`` times a checkpoint's shape without its weights: its config.json is written
to a scratch folder beside a fetched model's tokenizer (``--model``, for the prompt's ids), and vLLM
loads dummy weights (speed only; the tokens mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# the public config.json of each shape (meta-llama/Llama-3.2-1B-Instruct)
SHAPES = {"llama-3.2-1b": {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "vocab_size": 128256, "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16"}}


NEXT_TURN_TOKENS = 100  # new tokens in the conversation's next turn


def shape_dir(shape: str, tokenizer_dir: Path, scratch: Path) -> Path:
    """A model folder of ``shape``'s config and ``tokenizer_dir``'s tokenizer files, no weights."""
    (scratch / "config.json").write_text(json.dumps(SHAPES[shape]))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (scratch / name).write_bytes((tokenizer_dir / name).read_bytes())
    return scratch


def one_engine(args) -> dict:
    """This process's engine (icekv's settings or none) timed on the context: seconds per token."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    icekv = {"policy": args.policy, "budget": args.budget} if args.policy != "none" else None
    extra = {"worker_cls": "icekv.vllm.worker.IceKVCPUWorker", "additional_config": {"icekv": icekv}} if icekv else {}
    if args.shape:
        extra["load_format"] = "dummy"
    llm = LLM(model=args.model, dtype=args.dtype, block_size=32,
              max_model_len=args.context + 2 * args.tokens + NEXT_TURN_TOKENS + 64, enforce_eager=True,
              enable_prefix_caching=True, **extra)
    text = " ".join(Path(f).read_text() for f in sorted(Path(args.texts).glob("*.txt")))
    all_ids = llm.get_tokenizer().encode(text)
    ids, follow_up = all_ids[: args.context], all_ids[args.context: args.context + NEXT_TURN_TOKENS]

    def steps(prompt_ids: list[int], tokens: int) -> tuple[list[float], list[int]]:
        """One request decoding ``tokens`` tokens: the seconds of each engine step, and its tokens."""
        engine = llm.llm_engine
        engine.add_request(f"timed-{time.perf_counter_ns()}", TokensPrompt(prompt_token_ids=prompt_ids),
                           SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        times, out, t0 = [], [], time.perf_counter()
        while engine.has_unfinished_requests():
            for finished in (o for o in engine.step() if o.finished):
                out = list(finished.outputs[0].token_ids)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        return times, out

    prefill_s = sum(steps(ids, 1)[0])  # the prefill, and the prefix cache holds the prompt from here on
    steps(ids, args.tokens + 2)  # warm-up
    runs, next_turns = [], []
    for _ in range(args.repeats):
        times, answer = steps(ids, args.tokens + 2)
        runs.append(times)
        next_turns.append(sum(steps(ids + answer + follow_up, 2)[0]))
    tpots = [statistics.median(r[2:]) for r in runs]
    tpot = statistics.median(tpots)
    first_s = statistics.median(sum(r[:2]) for r in runs)  # the prompt from the cache, then the index build
    stats = llm.collective_rpc("icekv_stats")[0] if icekv else {}
    return {"policy": "vllm" if icekv is None else args.policy, "budget": args.budget if icekv else None,
            "tpot_s": tpot, "tpots_s": tpots, "until_decoding_s": first_s,
            "next_turn_until_decoding_s": statistics.median(next_turns), "prefill_s": prefill_s,
            "steps_per_request": len(runs[0]), "icekv_stats": stats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--texts", default=str(Path.home() / ".cache/icekv/texts/essays"))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32, help="timed decode tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a checkpoint's shape, dummy weights")
    parser.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # set in a child: its engine ("none": vLLM's)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.policy is not None:
        print(json.dumps(one_engine(args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="icekv-shape-") as scratch:
        model = str(shape_dir(args.shape, Path(args.model), Path(scratch))) if args.shape else args.model
        records = []
        for policy in ("none", "icecache"):  # plain vLLM first, then the plugin: one engine at a time
            child = [sys.executable, __file__, "--model", model, "--texts", args.texts, "--context", str(args.context),
                     "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--dtype", args.dtype,
                     "--budget", str(args.budget), "--policy", policy] + (["--shape", args.shape] if args.shape else [])
            proc = subprocess.run(child, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            records.append(json.loads(lines[0]))
            print(records[-1], flush=True)
    result = {"command": " ".join(["bench/vllm_tpot.py", *sys.argv[1:]]), "context": args.context, "dtype": args.dtype,
              "shape": args.shape,
              "records": records, "ratio": records[1]["tpot_s"] / records[0]["tpot_s"]}
    print(json.dumps(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
