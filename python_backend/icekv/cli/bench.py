"""`icekv bench decode | batch`: plan the run's admission and memory, then time it.

Before anything loads, the run's plan (:mod:`icekv.eval.bench_plan`) sizes the pool, the device
limit and ``max_active_requests`` for what it runs and checks that the engine admits every (policy,
context, batch) in one wave and that each engine's memory fits the machine; a run that would not
is refused with the numbers (``--plan`` prints the plan and stops there). Then one engine per
pool placement times its policies. With ``--json`` each record is printed as one JSON line as it
is measured (and flushed): a plan line first, then the records, an ``error`` line for a policy
group that failed (the others still run; the exit status is then 1) and a ``meta`` line last.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import replace

from icekv.cli.common import _csv, _device_settings, _icecache_config, _kv_dtype, _timed
from icekv.errors import IcekvError


def _cmd_bench(args) -> int:
    from icekv.config.engine import EngineConfig

    contexts = _csv("--contexts", args.contexts, int)
    if min(contexts) < 2:
        raise IcekvError(f"--contexts values must be >= 2 tokens, got {args.contexts}")
    policies = _csv("--policies", args.policies, str)
    warmup = {} if args.warmup_steps is None else {"warmup_steps": args.warmup_steps}
    if args.bench_command == "batch":
        from icekv.eval.batch_bench import BatchBenchConfig, run_batch_bench
        from icekv.eval.batch_report import write_batch_report as write_report

        batches = _csv("--batch", args.batch, int)
        if min(batches) < 1:
            raise IcekvError(f"--batch values must be >= 1, got {args.batch}")
        cfg = BatchBenchConfig(contexts, batches, policies, args.budget, args.steps, icecache=_icecache_config(args),
                               repeats=args.repeats, **warmup)
        run, peer = run_batch_bench, False
        line = lambda r: f"{r['context']:>6} x{r['batch']:<3} {r['policy']:<12} {r['tokens_per_s']:8.1f} tokens/s"
    else:
        from icekv.eval.decode_bench import DecodeBenchConfig, run_decode_bench
        from icekv.eval.report import write_decode_report as write_report

        ttft = _csv("--ttft-contexts", args.ttft_contexts, int) if args.ttft_contexts else ()
        if set(ttft) - set(contexts):
            raise IcekvError(f"--ttft-contexts {args.ttft_contexts} must be among --contexts {args.contexts}")
        cfg = DecodeBenchConfig(contexts, policies, args.budget, args.steps, peer_hf=args.peer == "hf",
                                ttft_contexts=ttft, icecache=_icecache_config(args),
                                unlimited_layers=args.unlimited_layers, repeats=args.repeats, window=args.window,
                                **warmup)
        batches, run, peer = (1,), run_decode_bench, cfg.peer_hf
        line = lambda r: f"{r['context']:>6} {r['policy']:<16} {r['tpot_s'] * 1000:8.1f} ms/token"
    from icekv.eval.decode_bench import plans_for

    plans = plans_for(cfg)  # each policy resolved once, before anything loads
    settings = _device_settings(args)
    device_type = _device_type(settings.get("device", EngineConfig.device), resolve=not args.plan)
    groups = _pool_groups(plans, settings, device_type)
    plan = _plan(args, settings, device_type, groups, cfg, batches, peer, plans)
    out = _Printer(args.json)
    out.plan(plan)
    if not plan.admitted:
        raise IcekvError("this run would not be admitted in one wave or does not fit the machine: "
                         + "; ".join(plan.problems()))
    if args.plan:
        return 0
    # the text whose prefill is tiled into each context; a random-weight model has no vocabulary
    # (and where it runs, no texts are fetched): any bytes will do
    from icekv.assets import Assets

    printable = bytes(range(32, 127)).decode()
    seed_text = Assets().haystack_text("essays") if args.random_weights is None else printable * 64
    scheduler = plan.scheduler
    records, meta, failed = [], {}, False
    for i, (pool_settings, group) in enumerate(groups):
        part = replace(cfg, policies=group, **({"peer_hf": False} if i and args.bench_command == "decode" else {}))
        try:
            more, part_meta = _run_group(args, plan, scheduler, pool_settings, part, run, plans, seed_text, out)
        except Exception as e:  # this group's records are lost, not the others'
            failed = True
            traceback.print_exc(file=sys.stderr)
            out.error(group, e)
            continue
        records += more
        meta = {**part_meta, "wall_s": round(meta.get("wall_s", 0) + part_meta["wall_s"], 1)}
    meta["plan"] = plan.lines()
    if args.out:
        write_report(records, args.out, meta)
    if args.json:
        out.meta(meta)
    else:
        print("\n".join(map(line, records)))
    return 1 if failed else 0


def _device_type(device: str, resolve: bool) -> str:
    """The compute device's type; without ``resolve`` read from the setting alone (a plan for a
    GPU machine can be made on a CPU)."""
    if resolve or device == "auto":
        from icekv.devices import resolve_device

        return resolve_device(device).type
    return "cuda" if device.startswith("cuda") else "cpu"


def _plan(args, settings: dict, device_type: str, groups, cfg, batches, peer: bool, plans: dict):
    from icekv.config.engine import EngineConfig
    from icekv.eval.bench_plan import BenchRun, plan_bench

    run = BenchRun(cfg.contexts, batches, plans, tuple((_placement(s, plans[g[0]]), g) for s, g in groups),
                   cfg.max_tokens, cfg.seed_tokens, peer)
    engine = EngineConfig(dtype=settings.get("dtype"), weights=settings.get("weights", "auto"))
    return plan_bench(_model_args(args), engine.dtype_on(device_type), run, _machine(args, device_type),
                      _kv_dtype(args), engine.weights_on(device_type))


def _placement(pool_settings: dict, plan) -> str:
    from icekv.config.engine import EngineConfig

    return EngineConfig(kv_pool=pool_settings.get("kv_pool", "auto")).pool_placement(plan.sparse)


def _model_args(args):
    from icekv.model import ModelArgs

    if args.random_weights is not None:
        from icekv.model.random import shape_args

        return shape_args(args.random_weights)
    from icekv.engine.model_dir import resolve_model_dir

    return ModelArgs.from_dir(resolve_model_dir(args.model))


def _machine(args, device_type: str):
    """The memory the plan checks against: the flags', else this machine's."""
    from icekv.eval.bench_plan import GIB, Machine

    host = int(args.host_memory_gib * GIB) if args.host_memory_gib else os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    device = int(args.device_memory_gib * GIB) if args.device_memory_gib else None
    if device is None and device_type == "cuda" and not args.plan:
        import torch

        device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Machine(device_type, host, device)


def _run_group(args, plan, scheduler, pool_settings: dict, part, run, plans: dict, seed_text: str, out):
    """One engine (one pool placement) times its policies; each record printed as it comes."""
    from icekv.config.engine import EngineConfig
    from icekv.engine import Engine

    threads = {"search_threads": args.search_threads} if getattr(args, "search_threads", None) is not None else {}
    engine = Engine(EngineConfig(model_dir=args.model, paging=plan.paging, scheduler=scheduler, **pool_settings,
                                 **threads))
    _check_device_free(engine, plan)
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        return _timed(engine, lambda _: run(engine, part, seed_text, plans, progress, out.record))
    finally:
        del engine  # before the next group's engine loads


def _check_device_free(engine, plan) -> None:
    """On a GPU, once loaded: the device memory the plan's requests hold must be free, before any prefill."""
    need = plan.scheduler.max_device_bytes
    if engine.device.type != "cuda" or need is None or engine.cache.pool_on_compute:
        return
    import torch

    free, _ = torch.cuda.mem_get_info(engine.device)
    if need > free:
        raise IcekvError(f"the requests need {need / 2**30:,.1f} GiB of device memory beside the model, "
                         f"{free / 2**30:,.1f} GiB is free once it is loaded")


def _pool_groups(plans: dict, settings: dict, device_type: str) -> list[tuple[dict, tuple[str, ...]]]:
    """Engine settings and the policies (of ``plans``) to time under them. On a GPU with ``kv_pool``
    left to auto, each policy runs where it would in serving (full attention with its pool on the
    device, a sparse policy with a host pool): one engine per placement. On a CPU the two are one."""
    from icekv.config.engine import EngineConfig

    if "kv_pool" in settings or device_type == "cpu":
        return [(settings, tuple(plans))]
    groups: dict[str, list[str]] = {}
    for name, plan in plans.items():
        groups.setdefault(EngineConfig().pool_placement(plan.sparse), []).append(name)
    return [({**settings, "kv_pool": pool}, tuple(group)) for pool, group in groups.items()]


class _Printer:
    """Stdout of a bench: with ``--json`` one flushed JSON line per plan, record, error and the
    meta; without, the plan on stderr (the records' table comes at the end)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def _line(self, obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    def plan(self, plan) -> None:
        print("\n".join(f"plan: {x}" for x in plan.lines()), file=sys.stderr, flush=True)
        if self.as_json:
            self._line({"plan": plan.to_dict()})

    def record(self, record: dict) -> None:
        if self.as_json:
            self._line(record)

    def error(self, policies, error: BaseException) -> None:
        print(f"icekv: error in {'+'.join(policies)}: {error}", file=sys.stderr, flush=True)
        if self.as_json:
            self._line({"error": f"{type(error).__name__}: {error}", "policies": list(policies)})

    def meta(self, meta: dict) -> None:
        self._line({"meta": meta})
