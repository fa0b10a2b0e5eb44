"""Where a quantized KV row's scale should live: per token (icekv's format) or per page and KV head.

A scale per page of P tokens saves 4 bytes per token and head (int8 / fp8 rows at 0.25x fp32
instead of 0.27x), but one outlier token (the attention sink's huge key, a spiking value) then sets
the step size of its whole page. This measures what each choice costs in accuracy, on a real
model's keys and values: prefill a needle prompt from the essays, record each layer's decode
queries for a few steps, then per layer quantize every token's K and V both ways (pages in
sequence order, as the pool holds them) and compare with the unquantized cache: relative error of
K and V, and each layer's full-attention output for the recorded queries, all heads together
(cosine; worst and mean over layers and steps).

    .venv/bin/python bench/kv_scale_granularity.py [--model smollm2-135m] [--length 4000] [--steps 4]
        [--page-size 16] [--out bench/results/kv_scale_granularity_<model>_<length>.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from selection_recall import record_decode_queries

from icekv.config.engine import EngineConfig
from icekv.engine import Engine
from icekv.kv.quant import _LARGEST, KVFormat


def per_page(x: torch.Tensor, fmt: str, page: int) -> torch.Tensor:
    """x [H, n, D] stored with one scale per ``page`` consecutive tokens of a head, read back."""
    h, n, d = x.shape
    pad = -n % page
    blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(h, -1, page, d)  # [H, pages, P, D]
    absmax = blocks.abs().amax((-2, -1), keepdim=True)  # [H, pages, 1, 1]
    scale = torch.where(absmax > 0, absmax / _LARGEST[fmt], 1.0)
    scaled = blocks / scale
    if fmt == "int8":
        codes = scaled.round().clamp(-127, 127)
    else:
        codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (codes * scale).view(h, -1, d)[:, :n]


def per_token(x: torch.Tensor, fmt: str, page: int) -> torch.Tensor:
    """x [H, n, D] as icekv's pool stores and reads it (a scale per token and head)."""
    return KVFormat(fmt).as_stored(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D] over k, v [Hkv, n, D] (GQA) -> [Hq, D]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
    w = torch.softmax((k @ q[:, :, None]).squeeze(-1) / q.shape[-1] ** 0.5, -1)  # [Hq, n]
    return (w[:, None] @ v).squeeze(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a registry name or model folder (default: the engine's)")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model_dir=args.model) if args.model else EngineConfig())
    ids, req, backend = record_decode_queries(engine, args.length, args.steps)
    ways = {f"{fmt}_{name}": (fmt, fn) for fmt in ("int8", "fp8_e4m3")
            for name, fn in (("token", per_token), ("page", per_page))}
    stats = {way: {"k_rel_err": [], "v_rel_err": [], "out_cosine": [], "out_cosine_min": []} for way in ways}
    for layer in range(engine.model.args.num_layers):
        k, v = engine.cache.gather(layer, req.seq_id)  # [Hkv, n, D] what the decode steps attended (prompt only)
        k, v = k[:, : len(ids)].float(), v[:, : len(ids)].float()
        exact = [attention(q.float(), k, v) for q in backend.queries[layer]]  # each [Hq, D]
        for way, (fmt, fn) in ways.items():
            qk, qv = fn(k, fmt, args.page_size), fn(v, fmt, args.page_size)
            stats[way]["k_rel_err"].append(float((qk - k).norm() / k.norm()))
            stats[way]["v_rel_err"].append(float((qv - v).norm() / v.norm()))
            for q, want in zip(backend.queries[layer], exact):
                got = attention(q.float(), qk, qv)
                # the layer's output for one step, all heads as o_proj reads them (a lone head's output
                # can be near zero when it rests on the sink, leaving its cosine meaningless)
                stats[way]["out_cosine"].append(float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), 0)))
            stats[way]["out_cosine_min"].append(min(stats[way]["out_cosine"][-len(exact):]))
    engine.release(req)
    summary = {way: {"k_rel_err_mean": sum(s["k_rel_err"]) / len(s["k_rel_err"]), "k_rel_err_max": max(s["k_rel_err"]),
                     "v_rel_err_mean": sum(s["v_rel_err"]) / len(s["v_rel_err"]), "v_rel_err_max": max(s["v_rel_err"]),
                     "out_cosine_mean": sum(s["out_cosine"]) / len(s["out_cosine"]),
                     "out_cosine_min": min(s["out_cosine"])} for way, s in stats.items()}
    command = "bench/kv_scale_granularity.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")
    result = {"command": command, "prompt_tokens": len(ids), "steps": args.steps, "page_size": args.page_size,
              "summary": summary, "per_layer": {w: {k: s[k] for k in ("k_rel_err", "v_rel_err", "out_cosine_min")} for w, s in stats.items()}}
    model = (args.model or "smollm2-135m").rstrip("/").split("/")[-1]
    out = args.out or Path(f"bench/results/kv_scale_granularity_{model}_{args.length}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{command}\n{'way':<16} {'K err mean/max':>18} {'V err mean/max':>18} {'out cos mean/min':>20}")
    for way, s in summary.items():
        print(f"{way:<16} {s['k_rel_err_mean']:>9.4f}/{s['k_rel_err_max']:<8.4f} {s['v_rel_err_mean']:>9.4f}/"
              f"{s['v_rel_err_max']:<8.4f} {s['out_cosine_mean']:>10.6f}/{s['out_cosine_min']:<9.6f}")


if __name__ == "__main__":
    main()
