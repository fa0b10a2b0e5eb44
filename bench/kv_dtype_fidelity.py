"""How closely a quantized KV pool follows the model-dtype pool on real text, per kv_dtype:

- next-token logits after short prompts (their prefill reads back the quantized K/V): cosine to
  the model-dtype pool's, and whether the top token is the same;
- greedy continuations of those prompts: share identical, and tokens before the first difference;
- every position of one long prompt scored: mean and max |log-probability gap| of the text's next
  token, and top-1 agreement;
- KV bytes per token held in the pool.

    PYTHONPATH=python_backend .venv/bin/python bench/kv_dtype_fidelity.py \\
        --out bench/results/kv_dtype_fidelity_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from icekv.assets import Assets
from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.engine.model_dir import resolve_model_dir

FULL = SelectionConfig(policy="full")  # the formats compared under full attention


def short_prompts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens taken at even strides through ``ids``."""
    stride = (len(ids) - length) // count
    return [ids[i * stride: i * stride + length] for i in range(count)]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(ref: Engine, got: Engine, ids: list[int], args) -> dict:
    cosines, same_top, same_text, agreed = [], 0, 0, []
    greedy = SamplingConfig(max_tokens=args.greedy_tokens, ignore_eos=True)
    for prompt in short_prompts(ids, args.prompts, args.prompt_tokens):
        a, b = ref.prefill(prompt), got.prefill(prompt)
        cosines.append(torch.nn.functional.cosine_similarity(a.logits.float(), b.logits.float(), 0).item())
        same_top += int(a.logits.argmax() == b.logits.argmax())
        ref.release(a), got.release(b)
        ta, tb = (e.generate(prompt, greedy, selection=FULL).token_ids for e in (ref, got))
        same_text += int(ta == tb)
        agreed.append(first_difference(ta, tb))
    scored = SamplingConfig(max_tokens=1, prompt_logprobs=1)
    long = ids[: args.long_tokens]
    pa, pb = (e.generate(long, scored, selection=FULL).prompt_logprobs[1:] for e in (ref, got))
    gap = torch.tensor([abs(x["logprob"] - y["logprob"]) for x, y in zip(pa, pb)])  # [long - 1] nats
    top = sum(x["top_logprobs"][0]["token_id"] == y["top_logprobs"][0]["token_id"] for x, y in zip(pa, pb))
    return {"logits_cosine_min": min(cosines), "logits_cosine_mean": sum(cosines) / len(cosines),
            "next_token_same": same_top / len(cosines), "greedy_identical": same_text / len(cosines),
            "greedy_tokens_before_difference_mean": sum(agreed) / len(agreed),
            "prompt_logprob_gap_mean": gap.mean().item(), "prompt_logprob_gap_max": gap.max().item(),
            "prompt_top1_same": top / len(pa), "kv_bytes_per_token": got.cache.bytes_per_token}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-dtypes", default="int8,fp8_e4m3")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    model_dir = str(resolve_model_dir(args.model))
    make = lambda kv: Engine(EngineConfig(model_dir=model_dir, paging=PagingConfig(kv_dtype=kv)))
    ref = make("auto")
    ids = ref.tokenizer.encode(Assets().haystack_text("essays"))
    result = {"meta": {"command": "bench/kv_dtype_fidelity.py " + " ".join(sys.argv[1:]), "model": args.model,
                       "dtype": str(ref.cache.dtype), "model_dtype_kv_bytes_per_token": ref.cache.bytes_per_token,
                       "machine": f"cpu, torch threads {torch.get_num_threads()}"},
              "kv_dtypes": {}}
    for kv in args.kv_dtypes.split(","):
        result["kv_dtypes"][kv] = measure(ref, make(kv), ids, args)
        print(kv, json.dumps(result["kv_dtypes"][kv]), flush=True)
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
