"""One engine timed on one prompt, in the venv that holds it: icekv (.venv), vLLM's CPU build
(.venv-vllm) or llama.cpp through llama-cpp-python (.venv-llamacpp). ``run.py`` starts it once per
engine and reads the JSON line it prints last; only the standard library is imported at the top,
each engine's package inside its own runner.

Every engine goes through the same protocol, greedy, one request at a time, with the same token ids
(the prompt, and the conversation's next turn: the prompt, the engine's own answer, then
``follow_up``):

1. ``prefill_s``: after a warm-up request on other ids of the same length (the prompt reversed),
   a one-token request on the prompt, cold: the whole prompt through the model;
2. a warm-up request, then ``tokens`` + 2 tokens decoded after the prompt, which each engine's
   prefix cache now holds: ``tpot_s`` is the median time between tokens from the third on (the
   first decode step builds icekv's index, and caches are cold);
3. ``next_turn_ttft_s``: a one-token request on prompt + answer + ``follow_up``, with the tokens
   the engine's prefix cache served (``next_turn_cached``: icekv under a selecting policy caches
   the prompt only, the others through the answer);
4. ``peak_rss_mib``: the peak of the summed resident memory of this process and its children
   (vLLM's engine core runs in one), sampled every 0.2 s.

Times are wall clock from the request's submission to each token's arrival. Each engine runs on
``--threads`` threads (all the cores this process may use): torch's and numba's for icekv,
OpenMP's bound to those cores for vLLM (none kept back for its scheduler), llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path


def arrivals_icekv(args):
    """A function (ids, n) -> (seconds from submission to each new token, the tokens, the prompt
    tokens the prefix cache served), and a label with the weight format, for icekv's engine."""
    import numba
    import torch

    from icekv.config.engine import EngineConfig
    from icekv.config.request import SamplingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine import Engine

    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    model = {"random_weights": args.random_weights} if args.random_weights else {"model_dir": args.model_dir}
    engine = Engine(EngineConfig(**model, weights=args.icekv_weights))
    selection = SelectionConfig(policy=args.icekv_policy, budget=args.budget)

    def run(ids: list[int], n: int) -> tuple[list[float], list[int], int]:
        start, times = time.perf_counter(), []
        seq = engine.submit(ids, SamplingConfig(max_tokens=n, temperature=0, ignore_eos=True), selection)
        while not seq.done:
            engine.step()
            produced = len(seq.stream.token_ids) if seq.stream is not None else 0  # no stream before decoding
            times += [time.perf_counter() - start] * (produced - len(times))
        out = engine.run(seq)
        return times, out.token_ids, out.cached_tokens

    budget = f" @{args.budget}" if args.icekv_policy != "full" else ""
    return run, f"icekv {engine.weights} weights, {args.icekv_policy}{budget}"


def arrivals_vllm(args):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)  # its KV pool, allocated whole at start
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))[:args.threads]))
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    dummy = {"load_format": "dummy", "skip_tokenizer_init": True} if args.random_weights else {}
    llm = LLM(model=args.model_dir, dtype=args.vllm_dtype, max_model_len=args.max_len, enable_prefix_caching=True,
              **dummy)
    engine = llm.llm_engine

    def run(ids: list[int], n: int) -> tuple[list[float], list[int], int]:
        start, times, tokens, cached = time.perf_counter(), [], [], 0
        engine.add_request(f"peer-{time.perf_counter_ns()}", TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                          detokenize=not args.random_weights))  # a dummy model has no tokenizer
        while engine.has_unfinished_requests():
            for output in engine.step():
                got = list(output.outputs[0].token_ids)
                times += [time.perf_counter() - start] * (len(got) - len(tokens))
                tokens, cached = got, output.num_cached_tokens or 0
        return times, tokens, cached

    return run, f"vLLM {vllm.__version__} {args.vllm_dtype}" + (" (dummy weights)" if args.random_weights else "")


def arrivals_llamacpp(args):
    import gguf
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.max_len, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)

    def run(ids: list[int], n: int) -> tuple[list[float], list[int], int]:
        """``generate`` keeps the KV of the longest prefix it shares with the last sequence."""
        evaluated = llm._input_ids.tolist()  # the sequence whose KV the context holds
        cached = next((i for i, (a, b) in enumerate(zip(evaluated, ids)) if a != b), min(len(evaluated), len(ids)))
        start, times, tokens = time.perf_counter(), [], []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter() - start)
            tokens.append(token)
            if len(tokens) == n:
                break
        return times, tokens, cached

    file_type = gguf.LlamaFileType(int(llm.metadata["general.file_type"])).name.removeprefix("MOSTLY_")
    return run, f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), GGUF {file_type}"


ENGINES = {"icekv": arrivals_icekv, "vllm": arrivals_vllm, "llamacpp": arrivals_llamacpp}


class PeakMemory:
    """The peak of the summed resident memory of this process and its descendants, sampled on a
    thread every ``period_s``."""

    def __init__(self, period_s: float = 0.2):
        self.peak_bytes, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(period_s,), daemon=True)
        self._thread.start()

    def _sample(self, period_s: float) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(period_s):
            self.peak_bytes = max(self.peak_bytes, page * sum(_resident_pages(pid) for pid in _tree(os.getpid())))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**20


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc."""
    out, todo = [], [pid]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                pass
    return out


def _resident_pages(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError):
        return 0  # it ended meanwhile


def measure(run, prompt: list[int], follow_up: list[int], tokens: int) -> dict:
    """The protocol of the module docstring over ``run`` (ids, n) -> (arrival seconds, tokens,
    cached prompt tokens)."""
    run(prompt[::-1], 1)  # warm-up on other ids of the same length: one-time costs (allocations, compiling)
    prefill_s = run(prompt, 1)[0][0]
    run(prompt, 4)  # warm-up from the prefix cache
    times, answer, _ = run(prompt, tokens + 2)
    gaps = [b - a for a, b in zip(times, times[1:])]
    next_turn = prompt + answer + follow_up
    next_turn_times, _, next_turn_cached = run(next_turn, 1)
    return {"prefill_s": prefill_s, "tpot_s": statistics.median(gaps[1:]), "decode_gaps_s": gaps,
            "next_turn_ttft_s": next_turn_times[0], "next_turn_cached": next_turn_cached,
            "prompt_tokens": len(prompt), "next_turn_tokens": len(next_turn)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), required=True)
    parser.add_argument("--ids", type=Path, required=True, help="JSON: {prompt: [...], follow_up: [...]}")
    parser.add_argument("--model-dir", required=True, help="with --random-weights: the shape's config.json folder")
    parser.add_argument("--random-weights", default=None, metavar="SHAPE",
                        help="a model of this shape with random weights (icekv.model.random; run.py --shape)")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--icekv-policy", default="icecache")
    parser.add_argument("--icekv-weights", default="auto")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--vllm-kv-gib", type=int, default=1)
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    ids = json.loads(args.ids.read_text())
    args.max_len = len(ids["prompt"]) + 2 * args.tokens + len(ids["follow_up"]) + 64
    memory = PeakMemory()
    run, label = ENGINES[args.engine](args)
    record = {"engine": args.engine, "label": label, "threads": args.threads,
              **measure(run, ids["prompt"], ids["follow_up"], args.tokens), "peak_rss_mib": memory.stop()}
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
