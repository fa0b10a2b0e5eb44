"""`icekv eval`, `bench decode | batch`, `size`: measuring accuracy, speed and memory."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from icekv.cli.common import _csv, _device_settings, _icecache_config
from icekv.errors import IcekvError


def _cmd_eval(args) -> int:
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
        depths=depths, num_needles=args.num_needles, icecache=_icecache_config(args), chat_template=args.chat_template,
    )
    return _run_and_report(args, lambda engine, text, progress: run_eval(engine, cfg, text, progress), write_report, "decode")


def _cmd_eval_compression(args) -> int:
    from icekv.compress import COMPRESSORS, parse_settings
    from icekv.eval.compression import CompressionEvalConfig, Variant, run_compression_eval
    from icekv.eval.report import write_compression_report

    methods = _csv("--compress", args.compress, str)
    for m in methods:
        if m not in COMPRESSORS:
            raise IcekvError(f"--compress: unknown method {m!r}; choose from {', '.join(COMPRESSORS)}")
    if args.kv2 is not None and "kv2" not in methods:
        raise IcekvError("--kv2 applies with --compress kv2 only")
    settings = {"kv2": parse_settings("kv2", args.kv2 or "")}
    cfg = CompressionEvalConfig(
        variants=tuple(Variant(m, m, settings.get(m, {})) for m in methods),
        kv_budgets=_csv("--kv-budgets", args.kv_budgets, float), tasks=_csv("--task", args.task, str),
        haystack=args.haystack, lengths=_csv("--lengths", args.lengths, int), samples=args.samples,
        questions=args.questions, seed=args.seed, chat_template=args.chat_template,
    )
    return _run_and_report(args, lambda engine, text, progress: run_compression_eval(engine, cfg, text, progress),
                           write_compression_report, "compression")


def _run_and_report(args, run, write, unit: str) -> int:
    """Load the model and the haystack, run an evaluation with a progress bar on stderr, save it."""
    from tqdm import tqdm

    from icekv.assets import Assets
    from icekv.config import EngineConfig
    from icekv.engine import Engine

    text = Assets().haystack_text(args.haystack)
    engine = Engine(EngineConfig(model_dir=args.model))
    bar = tqdm(desc="eval", unit=unit, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    records, meta = _timed(engine, lambda: run(engine, text, progress))
    bar.close()
    write(records, args.out, meta)
    print(f"wrote {args.out / 'results.json'}, report.md, accuracy.png")
    return 0


def _cmd_bench(args) -> int:
    from icekv.assets import Assets
    from icekv.config import EngineConfig, PagingConfig, SchedulerConfig, SelectionConfig
    from icekv.devices import resolve_device
    from icekv.engine import Engine

    contexts = _csv("--contexts", args.contexts, int)
    policies = _csv("--policies", args.policies, str)
    if args.bench_command == "batch":
        from icekv.eval.batch_bench import BatchBenchConfig, run_batch_bench
        from icekv.eval.batch_report import write_batch_report as write_report

        batches = _csv("--batch", args.batch, int)
        if min(batches) < 1 or min(contexts) < 2:
            raise IcekvError("--batch values must be >= 1 and --contexts >= 2 tokens")
        for policy in policies:
            SelectionConfig(policy=policy, budget=args.budget)  # errors early
        cfg = BatchBenchConfig(contexts, batches, policies, args.budget, args.steps, icecache=_icecache_config(args))
        paging = PagingConfig(max_context_tokens=max(batches) * (max(contexts) + args.steps + 32) + 2048)
        scheduler = SchedulerConfig(max_running=max(batches), max_step_tokens=max(batches) + 512)
        run = run_batch_bench
        line = lambda r: f"{r['context']:>6} x{r['batch']:<3} {r['policy']:<12} {r['tokens_per_s']:8.1f} tokens/s"
    else:
        from icekv.eval.decode_bench import DecodeBenchConfig, run_decode_bench
        from icekv.eval.report import write_decode_report as write_report

        for policy in policies:
            SelectionConfig(policy=policy, budget=args.budget, n_unlimited_layers=args.unlimited_layers)  # errors early
        ttft = _csv("--ttft-contexts", args.ttft_contexts, int) if args.ttft_contexts else ()
        if set(ttft) - set(contexts):
            raise IcekvError(f"--ttft-contexts {args.ttft_contexts} must be among --contexts {args.contexts}")
        cfg = DecodeBenchConfig(contexts, policies, args.budget, args.steps, peer_hf=args.peer == "hf",
                                ttft_contexts=ttft, icecache=_icecache_config(args),
                                unlimited_layers=args.unlimited_layers, repeats=args.repeats)
        paging = PagingConfig(max_context_tokens=max(contexts) + 2048 + args.steps + 16)
        scheduler = SchedulerConfig()
        run = run_decode_bench
        line = lambda r: f"{r['context']:>6} {r['policy']:<16} {r['tpot_s'] * 1000:8.1f} ms/token"
    # the text whose prefill is tiled into each context; a random-weight model has no vocabulary
    # (and where it runs, no texts are fetched): any bytes will do
    printable = bytes(range(32, 127)).decode()
    seed_text = Assets().haystack_text("essays") if args.random_weights is None else printable * 64
    settings = _device_settings(args)
    device_type = resolve_device(settings.get("device", EngineConfig.device)).type
    records, meta = [], {}
    peer_once = {"peer_hf": False} if args.bench_command == "decode" else {}
    for pool_settings, group in _pool_groups(policies, settings, device_type):
        engine = Engine(EngineConfig(model_dir=args.model, paging=paging, scheduler=scheduler, **pool_settings))
        part = replace(cfg, policies=group, **(peer_once if records else {}))  # the peer runs with the first group
        more, part_meta = _timed(engine, lambda: run(engine, part, seed_text, lambda m: print(m, file=sys.stderr)))
        records += more
        meta = {**part_meta, "wall_s": round(meta.get("wall_s", 0) + part_meta["wall_s"], 1)}
        del engine  # before the next group's engine loads
    if args.out:
        write_report(records, args.out, meta)
    print(json.dumps({"meta": meta, "records": records}) if args.json else "\n".join(map(line, records)))
    return 0


def _pool_groups(policies: tuple[str, ...], settings: dict, device_type: str) -> list[tuple[dict, tuple[str, ...]]]:
    """Engine settings and the policies to time under them. On a GPU with ``kv_pool`` left to
    auto, each policy runs where it would in serving (full attention with its pool on the device,
    a sparse policy with a host pool): one engine per placement. On a CPU the two are one."""
    from icekv.config import EngineConfig, SelectionConfig

    if "kv_pool" in settings or device_type == "cpu":
        return [(settings, policies)]
    groups: dict[str, list[str]] = {}
    for policy in policies:
        groups.setdefault(EngineConfig(selection=SelectionConfig(policy=policy)).pool_placement(), []).append(policy)
    return [({**settings, "kv_pool": pool}, tuple(group)) for pool, group in groups.items()]


def _timed(engine, run) -> tuple[list[dict], dict]:
    """A benchmark's records and what they were measured with (command, model, machine, wall time)."""
    import platform
    import time

    import torch

    t0 = time.perf_counter()
    records = run()
    meta = {"command": "icekv " + " ".join(sys.argv[1:]), "model": engine.model_name,
            "device": str(engine.device), "kv_pool": str(engine.cache.pool.device),
            "dtype": str(engine.cache.pool.dtype),
            "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            "wall_s": round(time.perf_counter() - t0, 1)}
    return records, meta


def _cmd_size(args) -> int:
    from icekv.config import IceCacheConfig, SelectionConfig
    from icekv.engine.engine import resolve_model_dir
    from icekv.model import ModelArgs
    from icekv.sizing import size

    model_args = ModelArgs.from_dir(resolve_model_dir(args.model))
    selection = SelectionConfig(policy="icecache", budget=args.budget, icecache=IceCacheConfig(score_dtype=args.score_dtype))
    plan = size(model_args, args.context, args.concurrent, selection, args.dtype)
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    print(f"KV per token (all {model_args.num_layers} layers, {args.dtype}): {plan.kv_bytes_per_token:,} bytes")
    print(f"host page pool for {args.concurrent} x {args.context} tokens: {mib(plan.host_pool_bytes)} "
          f"(--host-pool-tokens {args.concurrent * args.context})")
    print(f"device KV per request: full attention {mib(plan.device_bytes_full)}; "
          f"icecache budget {args.budget}: at most {mib(plan.device_bytes_budget)} ({plan.device_saving:.1f}x less)")
    keys = selection.icecache.page_keys(args.dtype)
    print(f"host memory of the icecache index per request ({keys} page keys): about {mib(plan.index_host_bytes)} "
          f"({plan.index_share:.0%} of its pages of the pool)")
    return 0
