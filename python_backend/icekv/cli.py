"""The ``icekv`` command line: ``fetch`` and ``generate`` (serve, eval, bench, compress, build
join as they land). Every user error prints ``icekv: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from icekv.errors import IcekvError


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="icekv", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch", help="download and convert the default model and haystack texts")
    fetch.add_argument("--what", choices=("all", "model", "essays", "kjv"), default="all")
    fetch.add_argument("--verify", action="store_true", help="re-hash every cached file")

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    gen.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=64)
    gen.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--page-size", type=_positive_int("--page-size"), default=None)
    gen.add_argument("--max-context", type=_positive_int("--max-context"), default=None,
                     help="KV pool capacity in tokens")
    gen.add_argument("--policy", default="full", help="full | streaming | quest | icecache | icecache_r")
    gen.add_argument("--budget", type=_positive_int("--budget"), default=256,
                     help="tokens attended per layer per KV head (sink and window included)")
    gen.add_argument("--context-key", default=None, help="answer over a stored compressed context (icekv compress)")
    gen.add_argument("--store", default=None, help="context store: a directory or redis://host:port (default: cache dir)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    comp = sub.add_parser("compress", help="compress a reusable context once and store it")
    comp.add_argument("--context-file", type=Path, required=True)
    comp.add_argument("--method", default="kv2", help="kv2 | kvzip | snapkv | keydiff | streaming")
    comp.add_argument("--kv-budget", type=float, default=0.05, help="share of the context's KV to keep, in (0, 1]")
    comp.add_argument("--rho", type=float, default=None, help="kv2: share of each chunk re-fed (default: the budget)")
    comp.add_argument("--rounds", type=_positive_int("--rounds"), default=1, help="kv2: refinement rounds")
    comp.add_argument("--store", default=None, help="a directory or redis://host:port (default: cache dir)")
    comp.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    comp.add_argument("--json", action="store_true")

    ev = sub.add_parser("eval", help="RULER-style accuracy across lengths, policies and budgets")
    ev.add_argument("--task", default="niah_single", help="comma list: niah_single, niah_multikey, niah_multivalue, passkey")
    ev.add_argument("--haystack", default="essays", help="essays | kjv | PATH to a text file")
    ev.add_argument("--lengths", default="2000", help="comma list of prompt lengths in tokens")
    ev.add_argument("--depths", default=None, help="comma list of needle depths in 0..1 (default: spread)")
    ev.add_argument("--policies", default="full,icecache")
    ev.add_argument("--budgets", default="256")
    ev.add_argument("--samples", type=_positive_int("--samples"), default=10)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--num-needles", type=_positive_int("--num-needles"), default=2)
    ev.add_argument("--compress", default=None,
                    help="reusable-context mode: comma list of kv2, kvzip, snapkv, keydiff, streaming")
    ev.add_argument("--kv-budgets", default="0.02,0.05,0.1,0.25", help="with --compress: shares of the KV kept")
    ev.add_argument("--questions", type=_positive_int("--questions"), default=4, help="with --compress: per context")
    ev.add_argument("--rho", type=float, default=None, help="with --compress: kv2 re-feed share (default: the budget)")
    ev.add_argument("--rounds", type=_positive_int("--rounds"), default=1, help="with --compress: kv2 refinement rounds")
    ev.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, accuracy.png")
    ev.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bd = bench_sub.add_parser("decode", help="time per output token by stage, across contexts and policies")
    bd.add_argument("--contexts", default="4096,8192,16384,32768")
    bd.add_argument("--policies", default="full,icecache,icecache_r")
    bd.add_argument("--budget", type=_positive_int("--budget"), default=256)
    bd.add_argument("--steps", type=_positive_int("--steps"), default=16)
    bd.add_argument("--peer", choices=("none", "hf"), default="none", help="hf: also time transformers' decoding")
    bd.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    bd.add_argument("--out", type=Path, default=None, help="write results.json + report.md + tpot.png here")
    bd.add_argument("--json", action="store_true")

    sz = sub.add_parser("size", help="host pool and device memory for a model, context length and budget")
    sz.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    sz.add_argument("--context", type=_positive_int("--context"), default=32768, help="tokens per request")
    sz.add_argument("--concurrent", type=_positive_int("--concurrent"), default=8, help="requests held at once")
    sz.add_argument("--budget", type=_positive_int("--budget"), default=256)
    sz.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    sz.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="run tritonserver with the icekv model until SIGINT/SIGTERM")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    serve.add_argument("--http-port", type=_positive_int("--http-port"), default=8000)
    serve.add_argument("--grpc-port", type=_positive_int("--grpc-port"), default=8001)
    serve.add_argument("--metrics-port", type=_positive_int("--metrics-port"), default=8002)
    serve.add_argument("--model-repository", type=Path, default=None,
                       help="serve this repository as is (default: generate one from the flags below)")
    _serving_flags(serve)

    demo = sub.add_parser("demo", help="serve with Triton and stream a needle answer over a long context")
    demo.add_argument("--length", type=_positive_int("--length"), default=3000, help="prompt tokens")
    demo.add_argument("--seed", type=int, default=0)
    _serving_flags(demo)
    return parser


def _serving_flags(parser) -> None:
    parser.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--policy", default=None, help="default page selection policy (config: icecache)")
    parser.add_argument("--budget", type=_positive_int("--budget"), default=None)
    parser.add_argument("--host-pool-tokens", type=_positive_int("--host-pool-tokens"), default=None,
                        help="KV page pool capacity in tokens, shared by all requests")
    parser.add_argument("--max-active-requests", type=_positive_int("--max-active-requests"), default=None)
    parser.add_argument("--store", default=None, help="context store for context_key requests: a directory or redis://")


def _serving_parameters(args) -> dict[str, str]:
    """CLI flags -> config.pbtxt parameters, validated here so a typo fails before the server starts."""
    from icekv.config import ServingConfig

    params = {"model_dir": args.model and str(Path(args.model).resolve()), "policy": args.policy,
              "budget": args.budget, "host_pool_tokens": args.host_pool_tokens,
              "max_active_requests": args.max_active_requests, "store": args.store}
    params = {k: str(v) for k, v in params.items() if v is not None}
    ServingConfig.from_triton_parameters(params)
    return params


def _cmd_serve(args) -> int:
    import signal
    import threading

    from icekv.serving.launcher import TritonServer

    params = _serving_parameters(args)
    if args.model_repository is not None and params:
        raise IcekvError("--model-repository is served as is: set parameters in its config.pbtxt, not with flags")
    server = TritonServer(params, args.model_repository, args.host, args.http_port, args.grpc_port, args.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"icekv serving: HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url}", file=sys.stderr)
    try:
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                raise IcekvError(f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}")
    finally:
        server.stop()
    return 0


def _open_store(location: str | None, engine):
    from icekv.config import default_cache_dir
    from icekv.store import ContextStore

    return ContextStore.open(location or str(default_cache_dir() / "contexts"), engine.model_id)


def _compressor_settings(args) -> dict:
    if args.method != "kv2":
        if args.rho is not None or args.rounds != 1:
            raise IcekvError("--rho and --rounds apply to --method kv2 only")
        return {}
    return {k: v for k, v in (("rho", args.rho), ("rounds", args.rounds)) if v is not None and (k != "rounds" or v != 1)}


def _cmd_compress(args) -> int:
    import resource
    import time

    from icekv.config import EngineConfig
    from icekv.engine import Engine
    from icekv.store import StoreError

    if not args.context_file.is_file():
        raise IcekvError(f"--context-file {args.context_file} is not a readable file")
    if not (0 < args.kv_budget <= 1):
        raise IcekvError(f"--kv-budget must be in (0, 1], got {args.kv_budget}")
    text = args.context_file.read_text()
    if not text.strip():
        raise IcekvError(f"--context-file {args.context_file} is empty")
    engine = Engine(EngineConfig(model_dir=args.model))
    ids = engine.tokenizer.encode(text)
    engine.check_fits(len(ids), 1)
    settings = _compressor_settings(args)
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


def _cmd_bench(args) -> int:
    import platform
    import time

    import torch

    from icekv.assets import Assets
    from icekv.config import EngineConfig, PagingConfig
    from icekv.engine import Engine
    from icekv.eval.decode_bench import DecodeBenchConfig, run_decode_bench

    contexts = _csv("--contexts", args.contexts, int)
    policies = _csv("--policies", args.policies, str)
    for p in policies:
        SelectionConfig_check(p, args.budget)
    cfg = DecodeBenchConfig(contexts, policies, args.budget, args.steps, peer_hf=args.peer == "hf")
    paging = PagingConfig(max_context_tokens=max(contexts) + 2048 + args.steps + 16)
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging))
    t0 = time.perf_counter()
    records = run_decode_bench(engine, cfg, Assets().haystack_text("essays"), lambda m: print(m, file=sys.stderr))
    meta = {"command": "icekv " + " ".join(sys.argv[1:]), "model": str(engine.model_dir),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "wall_s": round(time.perf_counter() - t0, 1)}
    if args.out:
        from icekv.eval.report import write_decode_report

        write_decode_report(records, args.out, meta)
    print(json.dumps({"meta": meta, "records": records}) if args.json else
          "\n".join(f"{r['context']:>6} {r['policy']:<16} {r['tpot_s'] * 1000:8.1f} ms/token" for r in records))
    return 0


def SelectionConfig_check(policy: str, budget: int) -> None:
    from icekv.config import SelectionConfig

    SelectionConfig(policy=policy, budget=budget)


def _cmd_size(args) -> int:
    from icekv.config import SelectionConfig
    from icekv.engine.engine import resolve_model_dir
    from icekv.model import ModelArgs
    from icekv.sizing import size

    model_args = ModelArgs.from_dir(resolve_model_dir(args.model))
    plan = size(model_args, args.context, args.concurrent, SelectionConfig(policy="icecache", budget=args.budget),
                args.dtype)
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    print(f"KV per token (all {model_args.num_layers} layers, {args.dtype}): {plan.kv_bytes_per_token:,} bytes")
    print(f"host page pool for {args.concurrent} x {args.context} tokens: {mib(plan.host_pool_bytes)} "
          f"(--host-pool-tokens {args.concurrent * args.context})")
    print(f"device KV per request: full attention {mib(plan.device_bytes_full)}; "
          f"icecache budget {args.budget}: at most {mib(plan.device_bytes_budget)} ({plan.device_saving:.1f}x less)")
    return 0


def _csv(flag: str, text: str, cast):
    try:
        values = tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise IcekvError(f"{flag}: cannot read {text!r} as a comma-separated list") from None
    if not values:
        raise IcekvError(f"{flag} is empty")
    return values


def _cmd_eval(args) -> int:
    import time

    from tqdm import tqdm

    from icekv.assets import Assets
    from icekv.config import EngineConfig
    from icekv.engine import Engine
    from icekv.eval.report import write_report
    from icekv.eval.runner import EvalConfig, run_eval

    if args.compress:
        return _cmd_eval_compression(args)
    depths = _csv("--depths", args.depths, float) if args.depths else None
    if depths and not all(0 <= d <= 1 for d in depths):
        raise IcekvError("--depths must lie in 0..1")
    cfg = EvalConfig(
        tasks=_csv("--task", args.task, str), haystack=args.haystack,
        lengths=_csv("--lengths", args.lengths, int), policies=_csv("--policies", args.policies, str),
        budgets=_csv("--budgets", args.budgets, int), samples=args.samples, seed=args.seed,
        depths=depths, num_needles=args.num_needles,
    )
    text = Assets().haystack_text(args.haystack)
    engine = Engine(EngineConfig(model_dir=args.model))
    bar = tqdm(desc="eval", unit="decode", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    t0 = time.perf_counter()
    records = run_eval(engine, cfg, text, progress)
    bar.close()
    meta = {"command": "icekv " + " ".join(sys.argv[1:]), "model": str(engine.model_dir),
            "wall_s": round(time.perf_counter() - t0, 1), "torch_threads": __import__("torch").get_num_threads()}
    write_report(records, args.out, meta)
    print(f"wrote {args.out / 'results.json'}, report.md, accuracy.png")
    return 0


def _cmd_eval_compression(args) -> int:
    import time

    from tqdm import tqdm

    from icekv.assets import Assets
    from icekv.config import EngineConfig
    from icekv.engine import Engine
    from icekv.eval.compression import CompressionEvalConfig, run_compression_eval
    from icekv.eval.report import write_compression_report

    kv2 = {k: v for k, v in (("rho", args.rho), ("rounds", args.rounds)) if v is not None and (k != "rounds" or v != 1)}
    cfg = CompressionEvalConfig(
        methods=_csv("--compress", args.compress, str), kv_budgets=_csv("--kv-budgets", args.kv_budgets, float),
        haystack=args.haystack, lengths=_csv("--lengths", args.lengths, int), samples=args.samples,
        questions=args.questions, seed=args.seed, settings=(("kv2", kv2),) if kv2 else (),
    )
    text = Assets().haystack_text(args.haystack)
    engine = Engine(EngineConfig(model_dir=args.model))
    bar = tqdm(desc="eval", unit="compression", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    t0 = time.perf_counter()
    records = run_compression_eval(engine, cfg, text, progress)
    bar.close()
    meta = {"command": "icekv " + " ".join(sys.argv[1:]), "model": str(engine.model_dir),
            "wall_s": round(time.perf_counter() - t0, 1)}
    write_compression_report(records, args.out, meta)
    print(f"wrote {args.out / 'results.json'}, report.md, accuracy.png")
    return 0


def _cmd_fetch(args) -> int:
    from icekv.assets import Assets

    assets = Assets()
    getters = {"model": assets.model_dir, "essays": assets.essays_dir, "kjv": lambda: assets.kjv_path().parent}
    for name, get in getters.items():
        if args.what in ("all", name):
            path = get()
            if args.verify:
                assets.verify(path)
            print(f"{name}: {path}")
    return 0


def _cmd_generate(args) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from icekv.config import EngineConfig, PagingConfig, SamplingConfig, SelectionConfig
    from icekv.engine import Engine

    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise IcekvError(f"--prompt-file {args.prompt_file} is not a readable file")
        prompt = args.prompt_file.read_text()
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise IcekvError("the prompt is empty (--prompt / --prompt-file)")
    paging = PagingConfig()
    if args.page_size is not None:
        paging = replace(paging, page_size=args.page_size)
    if args.max_context is not None:
        paging = replace(paging, max_context_tokens=args.max_context)
    sampling = SamplingConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    selection = SelectionConfig(policy=args.policy, budget=args.budget, page_size=paging.page_size)
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging, selection=selection))
    context = None
    if args.context_key is not None:
        context = _open_store(args.store, engine).load(args.context_key)
        if context is None:
            raise IcekvError(f"--context-key {args.context_key} is not in the context store")
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if total <= engine.config.prefill_chunk_tokens:
            return
        bar = bar or tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr)
        bar.update(done - bar.n)

    stream_out = None if args.json else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    result = engine.generate(prompt, sampling, on_text=stream_out, on_progress=progress, context=context)
    if bar:
        bar.close()
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        kv = result.kv
        print(
            f"[{result.prompt_tokens} prompt + {result.new_tokens} new tokens | prefill "
            f"{result.prefill_s:.2f} s | {result.tpot_s * 1000:.1f} ms/token | KV resident "
            f"{kv.resident_bytes / 2**20:.1f} MiB of {kv.total_bytes / 2**20:.1f} MiB]",
            file=sys.stderr,
        )
    return 0


def _cmd_demo(args) -> int:
    from icekv.assets import Assets
    from icekv.eval.tasks import HaystackSampler
    from icekv.model import Tokenizer
    from icekv.serving.client import Final, stream_generate
    from icekv.serving.launcher import TritonServer

    params = _serving_parameters(args)
    assets = Assets()
    model_dir = Path(args.model) if args.model else assets.model_dir()
    sample = HaystackSampler(assets.haystack_text("essays"), Tokenizer(model_dir)).make(
        "niah_single", args.length, seed=args.seed
    )
    print("starting tritonserver with the icekv model ...", file=sys.stderr)
    with TritonServer(params) as server:
        print(f"server ready: HTTP {server.http_url}, gRPC {server.grpc_url}")
        print(f"prompt: {sample.prompt_tokens} tokens of Paul Graham essays with one hidden needle")
        print("question:" + sample.prompt.rsplit("\n", 1)[-1])
        print("answer (streamed over gRPC):", end="", flush=True)
        text = ""
        for piece in stream_generate(server.grpc_url, sample.prompt, max_tokens=16, stop=["\n"]):
            if isinstance(piece, Final):
                final = piece
            else:
                text += piece
                print(piece, end="", flush=True)
    verdict = "correct" if sample.score(text) == 1 else "WRONG"
    print(f"\nexpected: {sample.answers[0]} -> {verdict}")
    print(
        f"policy {final.policy} (budget {final.budget} tokens per layer per KV head): "
        f"{final.prompt_tokens} prompt + {final.new_tokens} new tokens; KV cache "
        f"{final.kv_resident_bytes / 2**20:.1f} MiB resident on the device of "
        f"{final.kv_total_bytes / 2**20:.1f} MiB in the host pool, {final.kv_bytes_moved / 2**20:.1f} MiB moved"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"fetch": _cmd_fetch, "generate": _cmd_generate, "demo": _cmd_demo, "eval": _cmd_eval,
                "serve": _cmd_serve, "compress": _cmd_compress, "size": _cmd_size,
                "bench": _cmd_bench}
    try:
        return handlers[args.command](args)
    except IcekvError as e:
        print(f"icekv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
