"""A multi-turn conversation through a real tritonserver, with the prefix cache and without it.

The first user turn carries a document (essays, with one keyed needle per later question); every
turn resends the whole conversation through the model's chat template, as chat clients do. Each
turn is sent twice: as is (the prefix cache holds the earlier turns' pages) and with
``cache_prompt: false`` (prefilled from the first token), over the same history, so both see the
same prompt. Reports per turn the time to the first streamed piece, the whole request's time,
the tokens the cache held, and whether the two answers are identical; and the pages the cache
holds at the end against the conversation's length (one copy, not one per turn). Saves json + md
under bench/results/multiturn_<model>_<policy>/.

    .venv/bin/python bench/multiturn.py [--model smollm2-135m] [--length 3000] [--turns 10] [--policy full]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from icekv.assets import Assets
from icekv.eval.tasks import HaystackSampler, make_reusable
from icekv.model import Tokenizer
from icekv.serving.client import Final, stream_generate
from icekv.serving.launcher import TritonServer

PAGE = 16


def gauge(server: TritonServer, name: str) -> float:
    """One icekv metric's value from the server's /metrics."""
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def ask(url: str, messages: list[dict], max_tokens: int, **fields) -> dict:
    """One turn: its answer, time to the first piece, whole time and the Final's counts."""
    t0 = time.perf_counter()
    first, pieces = None, []
    for piece in stream_generate(url, None, messages=json.dumps(messages), max_tokens=max_tokens, **fields):
        if isinstance(piece, Final):
            final = piece
        else:
            first = first if first is not None else time.perf_counter() - t0
            pieces.append(piece)
    return {"answer": "".join(pieces), "ttft_s": first, "total_s": time.perf_counter() - t0,
            "prompt_tokens": final.prompt_tokens, "cached_tokens": final.cached_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=3000, help="document tokens")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assets = Assets()
    model_dir = assets.model_dir(args.model)
    sample = make_reusable(HaystackSampler(assets.haystack_text("essays"), Tokenizer(model_dir)), args.length,
                           args.seed, args.turns)
    questions = [q.strip() for q, _ in sample.questions]
    turns, messages = [], []
    server_settings = {"model_dir": str(model_dir), "policy": args.policy, "pool_tokens": str(args.pool_tokens),
                       "max_active_requests": "1"}
    with TritonServer(server_settings) as server:
        ask(server.grpc_url, [{"role": "user", "content": "Hello"}], 2)  # warm-up: first-request costs
        for t, question in enumerate(questions):
            messages.append({"role": "user", "content": (sample.context + "\n\n" if t == 0 else "") + question})
            cached = ask(server.grpc_url, messages, args.max_tokens)
            fresh = ask(server.grpc_url, messages, args.max_tokens, cache_prompt=False)
            turns.append({"turn": t + 1, "cached": cached, "uncached": fresh,
                          "same_answer": cached["answer"] == fresh["answer"],
                          "correct": sample.questions[t][1] in cached["answer"]})
            messages.append({"role": "assistant", "content": cached["answer"]})
            print(f"turn {t + 1}: ttft {cached['ttft_s']:.2f} s cached vs {fresh['ttft_s']:.2f} s, "
                  f"{cached['cached_tokens']}/{cached['prompt_tokens']} tokens held", flush=True)
        time.sleep(2)  # the metrics tick after the last request
        cached_pages = gauge(server, "icekv_prefix_cache_pages")
    last = turns[-1]["cached"]
    later = turns[1:]
    ratio = lambda key, run: sum(x[run][key] for x in later)  # noqa: E731
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "bench/multiturn.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                   if k != "out"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only", "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "document_tokens": sample.context_tokens,
        "turns": turns,
        "later_turns_ttft_ratio": ratio("ttft_s", "cached") / ratio("ttft_s", "uncached"),
        "conversation_speedup": sum(x["uncached"]["total_s"] for x in turns) / sum(x["cached"]["total_s"] for x in turns),
        "identical_answers": sum(x["same_answer"] for x in turns),
        "cached_pages_at_end": cached_pages, "last_prompt_tokens": last["prompt_tokens"],
    }
    out = args.out or Path(f"bench/results/multiturn_{args.model}_{args.policy}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = [f"# A {args.turns}-turn conversation with the prefix cache and without it", "",
          f"`{result['command']}` on {result['machine']}, commit {commit}, {result['date']}.", "",
          f"The first turn carries a {sample.context_tokens}-token document; every turn resends the whole conversation "
          f"(model {args.model}, policy {args.policy}, greedy, at most {args.max_tokens} new tokens). Each turn is sent "
          "as is and with `cache_prompt: false`, over the same history.", "",
          "| turn | prompt tokens | held by the cache | first piece s (cached) | first piece s (uncached) | ratio | "
          "request s (cached) | request s (uncached) | same answer | correct |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for x in turns:
        c, u = x["cached"], x["uncached"]
        md.append(f"| {x['turn']} | {c['prompt_tokens']} | {c['cached_tokens']} | {c['ttft_s']:.2f} | {u['ttft_s']:.2f} | "
                  f"{c['ttft_s'] / u['ttft_s']:.3f}x | {c['total_s']:.2f} | {u['total_s']:.2f} | "
                  f"{'yes' if x['same_answer'] else 'no'} | {'yes' if x['correct'] else 'no'} |")
    md += ["", f"Turns 2-{args.turns}: first piece in {result['later_turns_ttft_ratio']:.3f}x the uncached time (sums); "
           f"the whole conversation {result['conversation_speedup']:.2f}x faster; {result['identical_answers']}/"
           f"{len(turns)} answers identical. At the end the cache holds {cached_pages:.0f} pages "
           f"({cached_pages * PAGE:.0f} token slots) for a last prompt of {last['prompt_tokens']} tokens."]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
