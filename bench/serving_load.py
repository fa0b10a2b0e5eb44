"""Load test against a real tritonserver: N concurrent streaming clients x M requests each.

Each request is a ~2k-token needle prompt from the essays (a different one per request), streamed
over gRPC. Reports throughput, time to first token and end-to-end latency percentiles, errors and
whether every stream completed; saves json + md under bench/results/.

    .venv/bin/python bench/serving_load.py [--clients 8] [--requests 4] [--length 2000] [--max-tokens 24]

``--prompts essay`` is the decode-heavy variant: short essay passages continued without a stop
string (e.g. ``--length 64 --max-tokens 128 --name serving_load_decode``); "correct" then counts
streams that produced all ``max_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from icekv.assets import Assets
from icekv.eval.tasks import HaystackSampler
from icekv.model import Tokenizer
from icekv.serving.client import Final, stream_generate
from icekv.serving.launcher import TritonServer


@dataclass(frozen=True)
class EssayPassage:
    prompt: str


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--policy", default="icecache")
    ap.add_argument("--prompts", choices=("needle", "essay"), default="needle",
                    help="needle: RULER needle prompts, stop at a newline; essay: passages continued, no stop")
    ap.add_argument("--name", default="serving_load", help="file stem of the saved json + md")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    assets = Assets()
    tokenizer = Tokenizer(assets.model_dir())
    if args.prompts == "needle":
        sampler = HaystackSampler(assets.haystack_text("essays"), tokenizer)
        prompts = [[sampler.make("niah_single", args.length, seed=c * 100 + r) for r in range(args.requests)]
                   for c in range(args.clients)]
        stop = {"stop": ["\n"]}
    else:
        ids = tokenizer.encode(assets.haystack_text("essays"))
        prompts = [[EssayPassage(tokenizer.decode(ids[(c * args.requests + r) * 997:][: args.length]))
                    for r in range(args.requests)] for c in range(args.clients)]
        stop = {}
    records, errors = [], []

    def client(c: int, url: str) -> None:
        for sample in prompts[c]:
            t0 = time.perf_counter()
            first, text, final = None, "", None
            try:
                for piece in stream_generate(url, sample.prompt, max_tokens=args.max_tokens, policy=args.policy, **stop):
                    if isinstance(piece, Final):
                        final = piece
                    else:
                        first = first or time.perf_counter() - t0
                        text += piece
            except Exception as e:  # counted and reported, never hidden
                errors.append(f"client {c}: {e}")
                continue
            records.append({"client": c, "ttft_s": first, "latency_s": time.perf_counter() - t0,
                            "new_tokens": final.new_tokens if final else 0, "completed": final is not None,
                            "correct": sample.score(text) == 1.0 if args.prompts == "needle"
                            else final is not None and final.new_tokens == args.max_tokens})

    params = {"pool_tokens": str(65536), "max_active_requests": str(args.clients), "policy": args.policy}
    with TritonServer(params) as server:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c, server.grpc_url)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    lat = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    tokens = sum(r["new_tokens"] for r in records)
    result = {
        "command": "bench/serving_load.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "name")),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, CPU only",
        "requests": args.clients * args.requests, "completed": sum(r["completed"] for r in records),
        "errors": errors, "correct": sum(r["correct"] for r in records), "wall_s": wall,
        "throughput_req_s": len(records) / wall, "throughput_tok_s": tokens / wall,
        "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "mean_latency_s": statistics.mean(lat) if lat else None, "records": records,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    md = ["# Serving load test", "", f"`{result['command']}` on {result['machine']}", "",
          "| requests | completed | errors | correct answers | wall s | req/s | tok/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s |",
          "|---|---|---|---|---|---|---|---|---|---|---|",
          f"| {result['requests']} | {result['completed']} | {len(errors)} | {result['correct']} | {wall:.1f} | "
          f"{result['throughput_req_s']:.3f} | {result['throughput_tok_s']:.2f} | {result['latency_p50_s']:.1f} | "
          f"{result['latency_p99_s']:.1f} | {result['ttft_p50_s']:.1f} | {result['ttft_p99_s']:.1f} |", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
