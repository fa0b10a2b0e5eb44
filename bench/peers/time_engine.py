"""One engine timed on one prompt, in the venv that holds it: icekv (.venv), vLLM's CPU build
(.venv-vllm) or llama.cpp through llama-cpp-python (.venv-llamacpp). ``run.py`` starts it once per
engine and reads the JSON line it prints last; only the standard library is imported at the top,
each engine's package inside its own runner.

Every engine goes through the same protocol, greedy, one request at a time, with the same token ids
(the prompt, and the conversation's next turn: the prompt, the engine's own answer, then
``follow_up``):

1. ``prefill_s``: after a short warm-up request on other ids, a one-token request on the prompt,
   cold: the whole prompt through the model;
2. a warm-up request, then ``tokens`` + 2 tokens decoded after the prompt, which each engine's
   prefix cache now holds: ``tpot_s`` is the median time between tokens from the third on (the
   first decode step builds icekv's index, and caches are cold);
3. ``next_turn_ttft_s``: a one-token request on prompt + answer + ``follow_up``, which the prefix
   cache serves up to the answer;
4. ``peak_rss_mib``: the process's peak resident memory (vLLM's engine core runs in this process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path


def arrivals_icekv(args):
    """A function (ids, n) -> (seconds from submit to each new token, the tokens), and the
    weight format, for icekv's engine."""
    from icekv.config.engine import EngineConfig
    from icekv.config.request import SamplingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine import Engine

    engine = Engine(EngineConfig(model_dir=args.model_dir, weights=args.icekv_weights))
    selection = SelectionConfig(policy=args.icekv_policy, budget=args.budget)

    def run(ids: list[int], n: int) -> tuple[list[float], list[int]]:
        start = time.perf_counter()
        seq = engine.submit(ids, SamplingConfig(max_tokens=n, temperature=0, ignore_eos=True), selection)
        out = engine.run(seq)
        first = start + seq.prefill_s  # the first token comes from the prompt's last position
        steps = [first - start]
        for step in seq.step_s:  # each decode step's wall time: one token each
            steps.append(steps[-1] + step)
        return steps, out.token_ids

    budget = f" @{args.budget}" if args.icekv_policy != "full" else ""
    return run, f"icekv {engine.weights} weights, {args.icekv_policy}{budget}"


def arrivals_vllm(args):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)  # its KV pool, allocated whole at start
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its memory counted
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model_dir, dtype="bfloat16", max_model_len=args.max_len, enable_prefix_caching=True,
              enforce_eager=True)
    engine = llm.llm_engine

    def run(ids: list[int], n: int) -> tuple[list[float], list[int]]:
        engine.add_request(f"peer-{time.perf_counter_ns()}", TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        start, times, tokens = time.perf_counter(), [], []
        while engine.has_unfinished_requests():
            for output in engine.step():
                got = list(output.outputs[0].token_ids)
                times += [time.perf_counter() - start] * (len(got) - len(tokens))
                tokens = got
        return times, tokens

    import vllm

    return run, f"vLLM {vllm.__version__} bf16"


def arrivals_llamacpp(args):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.max_len, n_threads=os.cpu_count(),
                          n_threads_batch=os.cpu_count(), verbose=False)

    def run(ids: list[int], n: int) -> tuple[list[float], list[int]]:
        """``generate`` keeps the KV of the longest prefix it shares with the last sequence."""
        start, times, tokens = time.perf_counter(), [], []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter() - start)
            tokens.append(token)
            if len(tokens) == n:
                break
        return times, tokens

    import gguf

    file_type = gguf.LlamaFileType(int(llm.metadata["general.file_type"])).name.removeprefix("MOSTLY_")
    return run, f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), GGUF {file_type}"


ENGINES = {"icekv": arrivals_icekv, "vllm": arrivals_vllm, "llamacpp": arrivals_llamacpp}


def measure(run, prompt: list[int], follow_up: list[int], tokens: int) -> dict:
    """The protocol of the module docstring over ``run`` (ids, n) -> (arrival seconds, tokens)."""
    run(follow_up, 4)  # warm-up on other ids: one-time costs (first allocations, kernel choices)
    prefill_s = run(prompt, 1)[0][0]
    run(prompt, 4)  # warm-up from the prefix cache
    times, answer = run(prompt, tokens + 2)
    gaps = [b - a for a, b in zip(times, times[1:])]
    next_turn_s = run(prompt + answer + follow_up, 1)[0][0]
    return {"prefill_s": prefill_s, "tpot_s": statistics.median(gaps[1:]), "decode_gaps_s": gaps,
            "next_turn_ttft_s": next_turn_s, "prompt_tokens": len(prompt),
            "next_turn_tokens": len(prompt) + len(answer) + len(follow_up),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), required=True)
    parser.add_argument("--ids", type=Path, required=True, help="JSON: {prompt: [...], follow_up: [...]}")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--icekv-policy", default="icecache")
    parser.add_argument("--icekv-weights", default="auto")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--vllm-kv-gib", type=int, default=1)
    args = parser.parse_args()
    ids = json.loads(args.ids.read_text())
    args.max_len = len(ids["prompt"]) + 2 * args.tokens + len(ids["follow_up"]) + 64
    run, label = ENGINES[args.engine](args)
    record = {"engine": args.engine, "label": label, **measure(run, ids["prompt"], ids["follow_up"], args.tokens)}
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
