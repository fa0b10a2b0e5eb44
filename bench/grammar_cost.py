"""What constrained decoding costs per generated token: the grammar library's tokenizer build (once
per engine, at the first schema), a schema's compile (per request), and each step's mask (computed,
unpacked and applied to the logits) and token advance, walking a fixed JSON answer's tokens.
Requests without a schema pay none of it. Writes bench/results/grammar_cost.json.

    .venv/bin/python bench/grammar_cost.py [--models smollm2-135m,qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from icekv.config.request import SamplingConfig
from icekv.engine.grammar import Grammars
from icekv.model import ModelArgs, Tokenizer
from icekv.engine.model_dir import resolve_model_dir

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                           "population": {"type": "integer", "minimum": 0},
                                           "districts": {"type": "array", "items": {"type": "string"}}},
          "required": ["city", "population", "districts"], "additionalProperties": False}
ANSWER = '{"city": "Paris", "population": 2102650, "districts": ["Louvre", "Bourse", "Temple", "Marais"]}'


def measure(name: str) -> dict:
    folder = resolve_model_dir(name)
    tokenizer, args = Tokenizer(folder), ModelArgs.from_dir(folder)
    t0 = time.perf_counter()
    grammars = Grammars(tokenizer.to_json(), list(args.eos_token_ids))
    grammars.for_request(SamplingConfig(json_schema='{"type": "object"}'))  # builds the library's tokenizer
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = grammars.for_request(SamplingConfig(json_schema=json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    logits = torch.randn(args.vocab_size)  # [V]
    mask_s, accept_s = [], []
    for token in tokenizer.encode(ANSWER):
        t0 = time.perf_counter()
        grammar.mask(logits)
        t1 = time.perf_counter()
        grammar.accept(token)
        mask_s.append(t1 - t0)
        accept_s.append(time.perf_counter() - t1)
    return {"model": name, "vocab": args.vocab_size, "tokens": len(mask_s), "tokenizer_build_s": build_s,
            "schema_compile_s": compile_s, "mask_ms_median": 1e3 * statistics.median(mask_s),
            "mask_ms_max": 1e3 * max(mask_s), "accept_ms_median": 1e3 * statistics.median(accept_s),
            "complete": grammar.complete}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--out", type=Path, default=Path("bench/results/grammar_cost.json"))
    a = ap.parse_args()
    records = [measure(name) for name in a.models.split(",")]
    for r in records:
        print(f"{r['model']}: tokenizer {r['tokenizer_build_s']:.2f} s, schema {r['schema_compile_s'] * 1e3:.1f} ms, "
              f"mask {r['mask_ms_median']:.2f} ms (max {r['mask_ms_max']:.2f}), accept {r['accept_ms_median']:.3f} ms")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": "bench/grammar_cost.py --models " + a.models,
                                 "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
                                 "records": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
