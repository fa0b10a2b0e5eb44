"""Time per output token through the server against the engine's own, at one context length: what
the serving path (Triton's Python backend, the engine thread, streaming over gRPC) adds per token.

One `icekv serve`-like Triton server (settings from the flags), one streaming request at a time:
the first prefills the prompt, the timed ones find it in the prefix cache. A request's time per
token is (time of its last piece - time of its first piece) / (new tokens - 1); the report gives the
median over --repeats. Then, with the server stopped, `icekv bench decode` times the engine alone
at the same context, settings and step count, and the report gives the ratio.

    .venv/bin/python bench/served_tpot.py --model qwen2.5-coder-0.5b --context 16384 --weights int8 \
        --out bench/results/served_tpot_qwen_16k_int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from icekv.assets import Assets
from icekv.model import Tokenizer
from icekv.serving.client import Final, stream_generate
from icekv.serving.launcher import TritonServer


def timed_request(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request: seconds per token between its first and last pieces, and its counts."""
    start, first, last, final = time.perf_counter(), None, None, None
    for piece in stream_generate(url, prompt, max_tokens=max_tokens, temperature=0.0):
        if isinstance(piece, Final):
            final = piece
        elif piece:
            last = time.perf_counter()
            first = first if first is not None else last
    per_token = (last - first) / (final.new_tokens - 1) if final.new_tokens > 1 else None
    return {"tpot_s": per_token, "first_piece_s": first - start, "new_tokens": final.new_tokens,
            "cached_tokens": final.cached_tokens, "prompt_tokens": final.prompt_tokens}


def engine_tpot(args) -> float:
    """The engine's own time per token (`icekv bench decode`) under the same settings."""
    command = [str(Path(sys.executable).parent / "icekv"), "bench", "decode", "--model", args.model,
               "--contexts", str(args.context), "--policies", args.policy, "--budget", str(args.budget),
               "--weights", args.weights, "--steps", str(args.max_tokens), "--repeats", str(args.repeats), "--json"]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    records = [json.loads(line) for line in lines if line.startswith('{"context"')]
    return records[0]["tpot_median_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--policy", default="icecache")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    assets = Assets()
    model_dir = assets.model_dir(args.model)
    tokenizer = Tokenizer(model_dir)
    prompt = tokenizer.decode(tokenizer.encode(assets.haystack_text("essays"))[: args.context])
    settings = {"model_dir": str(model_dir), "policy": args.policy, "budget": str(args.budget),
                "weights": args.weights, "pool_tokens": str(2 * (args.context + args.max_tokens) + 64),
                "max_active_requests": "1"}
    with TritonServer(settings) as server:
        prefill = timed_request(server.grpc_url, prompt, args.max_tokens)
        served = [timed_request(server.grpc_url, prompt, args.max_tokens) for _ in range(args.repeats)]
    timed = [r["tpot_s"] for r in served if r["tpot_s"] is not None]  # None: a reply of one token
    if not timed:
        raise SystemExit("every timed request ended after one token: nothing to time")
    served_tpot = statistics.median(timed)
    own_tpot = engine_tpot(args)
    result = {"command": " ".join(["bench/served_tpot.py", *sys.argv[1:]]), "settings": settings,
              "prefill_request": prefill, "served": served, "served_tpot_s": served_tpot,
              "engine_tpot_s": own_tpot, "ratio": served_tpot / own_tpot}
    print(json.dumps({k: result[k] for k in ("served_tpot_s", "engine_tpot_s", "ratio")}))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
