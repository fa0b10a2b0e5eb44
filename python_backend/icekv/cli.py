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
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")

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
    ev.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, accuracy.png")
    ev.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")

    demo = sub.add_parser("demo", help="answer a needle question over a long essay context")
    demo.add_argument("--length", type=_positive_int("--length"), default=3000, help="prompt tokens")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--model", help="Hugging Face model folder (default: embedded SmolLM2-135M)")
    return parser


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
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if total <= engine.config.prefill_chunk_tokens:
            return
        bar = bar or tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr)
        bar.update(done - bar.n)

    stream_out = None if args.json else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    result = engine.generate(prompt, sampling, on_text=stream_out, on_progress=progress)
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
    from icekv.config import EngineConfig, SamplingConfig
    from icekv.engine import Engine
    from icekv.eval.tasks import HaystackSampler

    engine = Engine(EngineConfig(model_dir=args.model))
    sample = HaystackSampler(Assets().haystack_text("essays"), engine.tokenizer).make(
        "niah_single", args.length, seed=args.seed
    )
    print(f"prompt: {sample.prompt_tokens} tokens of Paul Graham essays with one hidden needle")
    print("question:" + sample.prompt.rsplit("\n", 1)[-1])
    print("answer:", end="", flush=True)
    result = engine.generate(
        sample.prompt,
        SamplingConfig(max_tokens=16, stop=("\n",)),
        on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()),
    )
    print(f"\nexpected: {sample.answers[0]} -> {'correct' if sample.score(result.text) == 1 else 'WRONG'}")
    kv = result.kv
    print(
        f"prefill {result.prefill_s:.2f} s, {result.tpot_s * 1000:.1f} ms per output token; "
        f"KV cache: {kv.pages} pages, {kv.resident_bytes / 2**20:.1f} MiB resident of "
        f"{kv.total_bytes / 2**20:.1f} MiB"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"fetch": _cmd_fetch, "generate": _cmd_generate, "demo": _cmd_demo, "eval": _cmd_eval}
    try:
        return handlers[args.command](args)
    except IcekvError as e:
        print(f"icekv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
