"""Engine parity between the CPU and a device: the same random-weight Llama (llama-tiny) decodes
the same greedy tokens in fp32 on both, under full attention and IceCache (the tree walk, and the
centroids search, whose ranking by centroid runs on the device there, and whose rescoring can
too: those tokens must be the CPU's host-rescored ones), with the KV pool on the
host and on the device, one request at a time and batched, and over a KV²-compressed context;
in bf16 the device's logits stay close to the CPU's fp32 ones. Writes one json; exits 1 on a
mismatch; the json is rewritten after every check, so a run cut short keeps the checks it made.
``--device cpu`` runs the same comparison against a second CPU engine (a dry run of
this script where no GPU is present).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from icekv.config.engine import EngineConfig
from icekv.config.paging import PagingConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine

SHAPE = "llama-tiny"
LENGTHS = (300, 1000, 2500)  # prompt tokens: under, near and well over the budget's pages
SELECTIONS = {"full": SelectionConfig(policy="full"), "icecache": SelectionConfig(policy="icecache", budget=128),
              "icecache centroids": SelectionConfig(policy="icecache", budget=128,
                                                    icecache=IceCacheConfig(search="centroids"))}
# the centroids search with its candidates rescored on the device too: the same pages as the
# host's rescoring, so the CPU reference's tokens of "icecache centroids"
RESCORED = SelectionConfig(policy="icecache", budget=128,
                           icecache=IceCacheConfig(search="centroids", rescoring="device"))
MIN_BF16_COSINE = 0.99


def engine(device: str, dtype: str, kv_pool: str, weights: Engine | None = None) -> Engine:
    e = Engine(EngineConfig(random_weights=SHAPE, device=device, dtype=dtype, kv_pool=kv_pool,
                            paging=PagingConfig(pool_tokens=16384)))
    if weights is not None:  # the reference's weights exactly (generators differ across devices)
        e.model.load_state_dict({k: v.to(e.model.lm_head.weight.dtype) for k, v in weights.model.state_dict().items()})
    return e


def prompts(vocab: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(e: Engine, ids: list[list[int]], selection: SelectionConfig, batched: bool) -> list[list[int]]:
    sampling = SamplingConfig(max_tokens=24, ignore_eos=True)
    if not batched:
        return [e.generate(p, sampling, selection=selection).token_ids for p in ids]
    seqs = [e.submit(p, sampling, selection) for p in ids]
    return [e.run(s).token_ids for s in seqs]


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[bool, str]:
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    return got == want, f"{same}/{sum(map(len, want))} greedy tokens equal"


def compressed(e: Engine, ids: list[int], question: list[int]) -> list[int]:
    context = e.compress(ids, "kv2", 0.2)
    sampling = SamplingConfig(max_tokens=16, ignore_eos=True)
    return e.generate(question, sampling, selection=SELECTIONS["icecache"], context=context).token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="three prompt lengths: under, near and well over the budget (the dry run's are shorter)")
    args = parser.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if len(lengths) != 3:
        parser.error(f"--lengths needs three lengths, got {args.lengths!r}")
    t0 = time.perf_counter()
    ref = engine("cpu", "float32", "host")
    ids = prompts(ref.model.args.vocab_size, lengths)
    checks, ok = [], True

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "shape": SHAPE, "prompt_tokens": lengths, "passed": ok,
                                        "wall_s": round(time.perf_counter() - t0, 1), "checks": checks}, indent=1))

    def check(name: str, run) -> None:
        nonlocal ok
        try:
            passed, detail = run()
        except Exception:
            passed, detail = False, traceback.format_exc(limit=6)
        ok &= passed
        checks.append({"check": name, "passed": passed, "detail": detail})
        write()
        print(f"{'ok  ' if passed else 'FAIL'} {name}: {detail if passed else detail.splitlines()[-1]}", flush=True)

    expected = {(name, batched): greedy(ref, ids, sel, batched) for name, sel in SELECTIONS.items()
                for batched in (False, True)}
    for kv_pool in ("host", "device"):
        dev = engine(args.device, "float32", kv_pool, weights=ref)
        if kv_pool == "host" and dev.device.type == "cuda":
            check("the host pool is page-locked", lambda dev=dev: (dev.cache.pool.is_pinned(), str(dev.cache.pool.shape)))
        for (name, batched), want in expected.items():
            check(f"fp32 {name} {'batched' if batched else 'one at a time'}, pool on {kv_pool}",
                  lambda dev=dev, name=name, batched=batched, want=want:
                  agreement(greedy(dev, ids, SELECTIONS[name], batched), want))
        if kv_pool == "host":
            for batched in (False, True):
                check(f"fp32 icecache centroids rescored on the device {'batched' if batched else 'one at a time'}",
                      lambda dev=dev, batched=batched: agreement(greedy(dev, ids, RESCORED, batched),
                                                                 expected["icecache centroids", batched]))
        check(f"fp32 kv2-compressed context, pool on {kv_pool}",
              lambda dev=dev: agreement([compressed(dev, ids[2], ids[0][:20])], [compressed(ref, ids[2], ids[0][:20])]))
        del dev

    def bf16_logits():
        dev = engine(args.device, "bfloat16", "host", weights=ref)
        cosines = []
        for p in ids:
            want, got = ref.prefill(p).logits.float(), dev.prefill(p).logits.float()
            cosines.append(float(torch.nn.functional.cosine_similarity(want, got, dim=-1)))
        rounded = [round(c, 4) for c in cosines]
        return min(cosines) >= MIN_BF16_COSINE, f"last-token logits cosine vs fp32 CPU: {rounded}"

    check(f"bf16 prefill logits (cosine >= {MIN_BF16_COSINE})", bf16_logits)
    write()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
