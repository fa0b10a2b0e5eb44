"""`icekv eval` and `size`: measuring accuracy and memory (`bench decode | batch`: icekv.cli.bench)."""

from __future__ import annotations

import json
import sys

from icekv.cli.common import _csv, _device_settings, _icecache_config, _kv_dtype, _timed
from icekv.errors import IcekvError


def _cmd_eval(args) -> int:
    from icekv.eval.report import write_report
    from icekv.eval.runner import EvalConfig, run_eval

    if args.resume and not (args.out / "runs.jsonl").is_file():
        raise IcekvError(f"--resume: {args.out / 'runs.jsonl'} does not exist")
    if args.compress:
        if args.prefix_store:
            raise IcekvError("--prefix-store applies to the decode eval: a compression reads every token's pass")
        return _cmd_eval_compression(args)
    depths = _csv("--depths", args.depths, float) if args.depths else None
    if depths and not all(0 <= d <= 1 for d in depths):
        raise IcekvError("--depths must lie in 0..1")
    optional = {name: getattr(args, name) for name in ("questions", "max_tokens") if getattr(args, name) is not None}
    cfg = EvalConfig(
        tasks=_csv("--task", args.task, str), haystack=args.haystack,
        lengths=_csv("--lengths", args.lengths, int), policies=_csv("--policies", args.policies, str),
        budgets=_csv("--budgets", args.budgets, int), samples=args.samples, seed=args.seed,
        depths=depths, num_needles=args.num_needles, num_values=args.num_values, num_hops=args.num_hops,
        distinct_key_words=args.distinct_key_words,
        icecache=_icecache_config(args), chat_template=args.chat_template, **optional,
    )

    plans = cfg.plans()  # before the model loads: an unknown policy or a budget it cannot use fails at once

    def run(engine, text, progress, meta):
        return run_eval(engine, cfg, text, progress, log=args.out / "runs.jsonl", resume=args.resume,
                        on_context=lambda records: write_report(records, args.out, meta), plans=plans)

    return _run_and_report(args, run, write_report, "decode", pool_tokens=cfg.pool_tokens)


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
        questions=args.questions or 4, seed=args.seed, chat_template=args.chat_template,
    )

    def run(engine, text, progress, meta):
        return run_compression_eval(engine, cfg, text, progress, log=args.out / "runs.jsonl", resume=args.resume,
                                    on_context=lambda records: write_compression_report(records, args.out, meta))

    return _run_and_report(args, run, write_compression_report, "context", pool_tokens=cfg.pool_tokens)


def _run_and_report(args, run, write, unit: str, pool_tokens: int = 0) -> int:
    """Load the model (its KV pool holding at least ``pool_tokens``) and the haystack, run an
    evaluation with a progress bar on stderr, save it."""
    from tqdm import tqdm

    from icekv.assets import Assets
    from icekv.config.engine import EngineConfig, SchedulerConfig
    from icekv.config.paging import PagingConfig
    from icekv.engine import Engine

    text = Assets().haystack_text(args.haystack)
    paging = PagingConfig(pool_tokens=max(PagingConfig.pool_tokens, pool_tokens), kv_dtype=_kv_dtype(args))
    # an evaluation submits its answers in waves and each waits its turn however long the ones
    # before it take (serving's queue limit would fail a long context's later answers as busy)
    scheduler = SchedulerConfig(max_queue_wait_s=float("inf"))
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging, scheduler=scheduler, **_device_settings(args)))
    pages = _spill_to(args.prefix_store, engine)
    # the mean rate since the start (units differ in cost: one policy's decode takes 100x another's),
    # over this run's units only (those kept from a resumed log took no time)
    bar = tqdm(desc="eval", unit=unit, file=sys.stderr, smoothing=0)

    def progress(done: int, total: int, resumed: bool = False) -> None:
        bar.total = total
        if resumed:
            bar.initial = done
        bar.update(done - bar.n)

    try:
        records, meta = _timed(engine, lambda meta: run(engine, text, progress, meta))
    finally:
        bar.close()  # its line ended before an error's message
        if pages is not None:
            pages.close()  # every page handed to the store written (or failed) before the process ends
    write(records, args.out, meta)
    print(f"wrote {args.out / 'results.json'}, report.md, accuracy.png")
    return 0


def _spill_to(location: str | None, engine):
    """The store at ``location`` under the engine's prefix cache (None: none)."""
    if location is None:
        return None
    from icekv.store import ContextStore
    from icekv.store.prefix_pages import spill_prefixes

    store = ContextStore.open(location, engine.model_id)
    return spill_prefixes(engine.cache, store.backend, engine.model_id, store.secret, wait_when_full=True)


def _cmd_size(args) -> int:
    from icekv.config.selection import SelectionConfig
    from icekv.methods.icecache import IceCacheConfig
    from icekv.engine.model_dir import resolve_model_dir
    from icekv.model import ModelArgs
    from icekv.policies import resolve
    from icekv.sizing import size

    model_args = ModelArgs.from_dir(resolve_model_dir(args.model))
    selection = SelectionConfig(policy="icecache", budget=args.budget, icecache=IceCacheConfig(score_dtype=args.score_dtype))
    plan = size(model_args, args.context, args.concurrent, resolve(selection), args.dtype, _kv_dtype(args))
    if args.json:
        print(json.dumps(plan.to_dict()))
        return 0
    mib = lambda b: f"{b / 2**20:,.1f} MiB"
    stored = args.dtype if _kv_dtype(args) == "auto" else f"{_kv_dtype(args)} with a scale per token"
    print(f"KV per token (all {model_args.num_layers} layers, {stored}): {plan.kv_bytes_per_token:,} bytes")
    print(f"host page pool for {args.concurrent} x {args.context} tokens: {mib(plan.host_pool_bytes)} "
          f"(--pool-tokens {args.concurrent * args.context})")
    print(f"device KV per request: full attention {mib(plan.device_bytes_full)}; "
          f"icecache budget {args.budget}: at most {mib(plan.device_bytes_budget)} ({plan.device_saving:.1f}x less)")
    keys = selection.icecache.page_keys(args.dtype)
    print(f"host memory of the icecache index per request ({keys} page keys): about {mib(plan.index_host_bytes)} "
          f"({plan.index_share:.0%} of its pages of the pool)")
    return 0
