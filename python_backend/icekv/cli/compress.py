"""`icekv compress`: compress a reusable context once and store it."""

from __future__ import annotations

import json
import sys

from icekv.config.serving import check_kv_budget
from icekv.errors import IcekvError
from icekv.cli.common import _kv_dtype, _open_store


def _compressor_settings(args) -> dict:
    from icekv.compress import parse_settings

    if args.kv2 is not None and args.method != "kv2":
        raise IcekvError("--kv2 applies to --method kv2 only")
    return parse_settings("kv2", args.kv2 or "") if args.method == "kv2" else {}


def _read_context(args) -> str:
    if not args.context_file.is_file():
        raise IcekvError(f"--context-file {args.context_file} is not a readable file")
    check_kv_budget(args.kv_budget, "--kv-budget")
    text = args.context_file.read_text()
    if not text.strip():
        raise IcekvError(f"--context-file {args.context_file} is empty")
    return text


def _cmd_compress(args) -> int:
    text = _read_context(args)
    if args.server is not None:
        return _compress_on_server(args, text)
    return _compress_here(args, text)


def _compress_on_server(args, text: str) -> int:
    """A compress-only request: the server finds the context (memory, its store) or compresses it."""
    import time

    from icekv.serving.client import GenerateError, stream_generate

    for flag, value in (("--store", args.store), ("--model", args.model), ("--kv2", args.kv2)):
        if value is not None:
            raise IcekvError(f"{flag} does not apply with --server: the server's own model, store and kv2 "
                             "settings are used (icekv serve --kv2)")
    _check_reachable(args.server)
    t0 = time.perf_counter()
    try:
        *_, final = stream_generate(args.server, None, context=text, kv_method=args.method,
                                    kv_budget=args.kv_budget)
    except GenerateError as e:
        raise IcekvError(f"the server refused the context: {e}") from None
    wall = time.perf_counter() - t0
    report = {"key": final.context_key, "method": args.method, "kv_budget": args.kv_budget,
              "context_tokens": final.prompt_tokens, "context_cache": final.context_cache,
              "bytes_before": final.kv_total_bytes, "bytes_after": final.kv_resident_bytes, "wall_s": round(wall, 3)}
    if args.json:
        print(json.dumps(report))
    else:
        how = {"hit": "already compressed", "joined": "joined a running compression"}.get(final.context_cache,
                                                                                           "compressed now")
        print(f"key: {final.context_key}  ({how}, on {args.server})")
        print(f"{final.prompt_tokens} context tokens; KV bytes {final.kv_total_bytes / 2**20:.1f} MiB -> "
              f"{final.kv_resident_bytes / 2**20:.2f} MiB; wall {wall:.1f} s")
    return 0


def _check_reachable(url: str) -> None:
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(url)
        ready = client.is_model_ready("icekv")
    except Exception as e:  # a malformed address, nothing listening, not a Triton server
        raise IcekvError(f"cannot reach an icekv server at {url} (its gRPC HOST:PORT): {e}") from None
    if not ready:
        raise IcekvError(f"the server at {url} has no ready icekv model")


def _compress_here(args, text: str) -> int:
    import resource
    import time

    from icekv.config.engine import EngineConfig
    from icekv.config.paging import PagingConfig
    from icekv.engine import Engine
    from icekv.store import StoreError

    settings = _compressor_settings(args)
    engine = Engine(EngineConfig(model_dir=args.model, paging=PagingConfig(kv_dtype=_kv_dtype(args))))
    ids = engine.tokenizer.encode(text)
    engine.check_fits(len(ids), 1)
    store = _open_store(args.store, engine)
    key = store.key(ids, args.method, args.kv_budget, settings)
    cached = None
    try:
        cached = store.load(key)
    except StoreError as e:
        print(f"icekv: stored entry refused ({e}); recomputing", file=sys.stderr)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    ctx = cached or engine.compress(ids, args.method, args.kv_budget, **settings)
    wall = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    stored = store.save(key, ctx) if cached is None else None
    kept = [layer.kept_per_head for layer in ctx.layers]
    report = {
        "key": key, "method": args.method, "kv_budget": args.kv_budget, "context_tokens": len(ids),
        "store_hit": cached is not None, "kept_tokens_per_layer_head": kept,
        "kept_tokens": sum(map(sum, kept)), "bytes_before": ctx.full_bytes, "bytes_after": ctx.kv_bytes,
        "stored_bytes": stored, "wall_s": round(wall, 3), "peak_memory_growth_bytes": peak,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"key: {key}{'  (already stored)' if cached is not None else ''}")
        print(f"kept {report['kept_tokens']} of {len(ids) * len(kept) * len(kept[0])} (layer, head, token) entries; "
              f"KV bytes {ctx.full_bytes / 2**20:.1f} MiB -> {ctx.kv_bytes / 2**20:.2f} MiB")
        print("kept tokens per layer (per KV head): " + "; ".join(f"{i}:{'/'.join(map(str, k))}" for i, k in enumerate(kept)))
        print(f"wall {wall:.1f} s, peak memory growth {peak / 2**20:.0f} MiB")
    return 0
