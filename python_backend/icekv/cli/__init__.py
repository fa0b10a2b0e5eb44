"""The ``icekv`` command line: fetch, generate, compress, eval, bench, size, build, serve, demo.

Each subcommand lives in a small module (run, compress, measure, build); every user error prints
``icekv: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from icekv.cli.common import (_device_flags, _icecache_flags, _kv2_flag, _model_flag, _positive_int, _timeout,
                              _serving_flags, _serving_parameters, _setting_flag)
from icekv.cli.common import TRITON_GRPC_PORT, TRITON_METRICS_PORT, _bench_run_flags
from icekv.config.engine import default_cache_dir
from icekv.config.paging import PagingConfig
from icekv.config.selection import SelectionConfig
from icekv.config.serving import CompressionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.errors import IcekvError
from icekv.policies import policy_names
from icekv.registry import DEFAULT_MODEL, KNOWN_MODELS
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.replicas import ROUTER_POLICIES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="icekv", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch", help="download and convert a known model and the haystack texts; list the "
                                         "known models")
    fetch.add_argument("--what", choices=("all", "model", "essays", "kjv"), default="all")
    fetch.add_argument("--model", default=DEFAULT_MODEL, choices=tuple(KNOWN_MODELS),
                       help=f"the known model to fetch (default {DEFAULT_MODEL})")
    fetch.add_argument("--list", action="store_true", help="only list the known models, fetching nothing")
    fetch.add_argument("--verify", action="store_true", help="re-hash every cached file")

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    gen.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=64)
    _model_flag(gen)
    _device_flags(gen, random_weights=True)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--page-size", type=_positive_int("--page-size"), default=None)
    gen.add_argument("--pool-tokens", type=_positive_int("--pool-tokens"), default=None,
                     help="KV pool capacity in tokens")
    gen.add_argument("--policy", default=SelectionConfig.policy, help=" | ".join(policy_names()))
    gen.add_argument("--budget", type=_positive_int("--budget"), default=SelectionConfig.budget,
                     help="tokens attended per layer per KV head (sink and window included)")
    _icecache_flags(gen)
    gen.add_argument("--context-key", default=None, help="answer over a stored compressed context (icekv compress)")
    gen.add_argument("--store", default=None, help="context store: a directory or redis://host:port (default: cache dir)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    comp = sub.add_parser("compress", help="compress a reusable context once and store it")
    comp.add_argument("--context-file", type=Path, required=True)
    comp.add_argument("--method", default=CompressionConfig.method, help="kv2 | kvzip | snapkv | keydiff | streaming")
    comp.add_argument("--kv-budget", type=float, default=CompressionConfig.kv_budget,
                      help="share of the context's KV to keep, in (0, 1]")
    _kv2_flag(comp, "with --method kv2, its settings")
    comp.add_argument("--store", default=None, help="a directory or redis://host:port (default: cache dir)")
    _model_flag(comp)
    comp.add_argument("--server", default=None, metavar="HOST:PORT",
                      help="compress through a running icekv server (its gRPC address) into the server's store")
    comp.add_argument("--json", action="store_true")
    _setting_flag(comp, "kv_dtype")

    ev = sub.add_parser("eval", help="RULER-style accuracy across lengths, policies and budgets")
    ev.add_argument("--task", default="niah_single",
                    help="comma list: niah_single, niah_multikey, niah_multivalue, variable_tracking, passkey, "
                         "recall_all (every needle asked at once: a long answer), cot_arith (a word problem answered "
                         "with its reasoning, its facts through the context; a length it fills: the problem alone)")
    ev.add_argument("--haystack", default="essays", help="essays | kjv | PATH to a text file")
    ev.add_argument("--lengths", default="2000", help="comma list of prompt lengths in tokens")
    ev.add_argument("--depths", default=None, help="comma list of needle depths in 0..1 (default: spread)")
    ev.add_argument("--policies", default="full,icecache")
    ev.add_argument("--budgets", default=str(SelectionConfig.budget))
    ev.add_argument("--samples", type=_positive_int("--samples"), default=10)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--num-needles", type=_positive_int("--num-needles"), default=2,
                    help="niah_multikey: needles in all, the asked ones and distractors; recall_all: needles, "
                         "all asked")
    ev.add_argument("--distinct-key-words", action="store_true",
                    help="niah tasks: no two keys of a context share a word (by default they may, which makes "
                         "keys easier to mistake for one another)")
    ev.add_argument("--num-values", type=_positive_int("--num-values"), default=2,
                    help="niah_multivalue: values of each asked key")
    ev.add_argument("--num-hops", type=_positive_int("--num-hops"), default=4,
                    help="variable_tracking: assignments after the first in each chain; cot_arith: changes after "
                         "the start")
    ev.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=None,
                    help="least tokens decoded per answer (default 12); an expected answer that is longer "
                         "(several values, a chain of names) always gets room for all of it")
    ev.add_argument("--resume", action="store_true",
                    help="keep the contexts (and questions) --out/runs.jsonl already holds (same grid) and run the rest")
    ev.add_argument("--compress", default=None,
                    help="reusable-context mode: comma list of kv2, kvzip, snapkv, keydiff, streaming")
    ev.add_argument("--kv-budgets", default="0.02,0.05,0.1,0.25", help="with --compress: shares of the KV kept")
    ev.add_argument("--questions", type=_positive_int("--questions"), default=None,
                    help="asked of each prefilled context, each of its own needle, key or chain (default 1; with "
                         "--compress: 4)")
    _kv2_flag(ev, "with --compress kv2, its settings")
    _setting_flag(ev, "weights")
    _setting_flag(ev, "kv_dtype")
    ev.add_argument("--chat-template", action="store_true",
                    help="ask each question as a user turn of the model's chat template (answer prefix after it)")
    _icecache_flags(ev)
    ev.add_argument("--out", type=Path, required=True, help="directory for results.json, report.md, accuracy.png")
    ev.add_argument("--prefix-store", nargs="?", const=str(default_cache_dir() / "eval-prefixes"), default=None,
                    metavar="DIR|redis://HOST:PORT",
                    help="keep each context's KV pages in this store (the prefix cache's lower tier, at most 8 GiB, "
                         "least recently used out first; given no value: eval-prefixes in the cache directory): a "
                         "later or resumed run over the same contexts reads them back instead of prefilling")
    _model_flag(ev)

    fid = sub.add_parser("fidelity",
                         help="teacher-forced fidelity of policies against the full cache over a long output")
    given = fid.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt-file", type=Path, help="the prompt (any text)")
    given.add_argument("--haystack", help="or a long context: the first --length tokens of this text (essays | kjv | "
                                          "PATH), then --ask")
    fid.add_argument("--length", type=_positive_int("--length"), default=8000, help="with --haystack: context tokens")
    fid.add_argument("--ask", default="Rewrite the text above in full, paragraph by paragraph, in your own words, "
                                      "leaving nothing out.",
                     help="with --haystack: the request after the context")
    fid.add_argument("--chat-template", action="store_true", help="send it as a user turn of the model's chat template")
    fid.add_argument("--new-tokens", type=_positive_int("--new-tokens"), default=1024,
                     help="the full cache's output, at most this long, fed back under each policy")
    fid.add_argument("--temperature", type=float, default=0.0,
                     help="the full cache's output: greedy at 0, else sampled at this temperature (less likely "
                          "than a greedy one to end in a loop that repeats itself)")
    fid.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0: nucleus sampling's mass")
    fid.add_argument("--seed", type=int, default=0, help="with --temperature > 0: the sampler's seed")
    fid.add_argument("--policies", default="icecache")
    fid.add_argument("--budgets", default=str(SelectionConfig.budget))
    fid.add_argument("--window", type=_positive_int("--window"), default=128, help="output positions per report column")
    fid.add_argument("--recall", action="store_true",
                     help="also measure each sparse policy's selection recall per position (full attention's mass "
                          "on the tokens it attended; slower)")
    fid.add_argument("--top", type=_positive_int("--top"), default=64,
                     help="the full cache's most likely tokens kept per position, over which KL is measured")
    _icecache_flags(fid)
    fid.add_argument("--out", type=Path, required=True, help="directory for results.json and report.md")
    _model_flag(fid)
    _device_flags(fid)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bd = bench_sub.add_parser("decode", help="time per output token by stage, across contexts and policies")
    bd.add_argument("--contexts", default="4096,8192,16384,32768")
    bd.add_argument("--policies", default="full,icecache,icecache_r")
    bd.add_argument("--budget", type=_positive_int("--budget"), default=SelectionConfig.budget)
    bd.add_argument("--steps", type=_positive_int("--steps"), default=16)
    bd.add_argument("--repeats", type=_positive_int("--repeats"), default=1,
                    help="timed decodes per policy, interleaved across policies; reports the medians")
    bd.add_argument("--window", type=_positive_int("--window"), default=None,
                    help="also report the timed steps in windows of this many (a long output: --steps 4096 "
                         "--window 256): step times, stage split, KV and index bytes added per token")
    bd.add_argument("--peer", choices=("none", "hf"), default="none", help="hf: also time transformers' decoding")
    _icecache_flags(bd)
    bd.add_argument("--unlimited-layers", type=int, default=SelectionConfig.n_unlimited_layers,
                    help="first layers that keep their whole cache (0: every layer budgeted)")
    bd.add_argument("--ttft-contexts", default=None,
                    help="comma list of --contexts to really prefill (slow) and report time to first token")
    _model_flag(bd)
    _device_flags(bd, random_weights=True)
    bd.add_argument("--out", type=Path, default=None, help="write results.json + report.md + tpot.png here")
    bd.add_argument("--json", action="store_true")
    _bench_run_flags(bd)

    bb = bench_sub.add_parser("batch", help="aggregate decode throughput of requests batched together")
    bb.add_argument("--contexts", default="4096,16384")
    bb.add_argument("--batch", default="1,2,4,8", help="comma list of requests decoding together")
    bb.add_argument("--policies", default="full,icecache")
    bb.add_argument("--budget", type=_positive_int("--budget"), default=SelectionConfig.budget)
    bb.add_argument("--steps", type=_positive_int("--steps"), default=32)
    bb.add_argument("--repeats", type=_positive_int("--repeats"), default=1,
                    help="timed runs per (batch, policy), interleaved (every other pass reversed); reports the medians")
    _setting_flag(bb, "search_threads")
    _icecache_flags(bb)
    _model_flag(bb)
    _device_flags(bb, random_weights=True)
    bb.add_argument("--out", type=Path, default=None, help="write results.json + report.md + throughput.png here")
    bb.add_argument("--json", action="store_true")
    _bench_run_flags(bb)

    sz = sub.add_parser("size", help="host pool and device memory for a model, context length and budget")
    _model_flag(sz)
    sz.add_argument("--context", type=_positive_int("--context"), default=PagingConfig.pool_tokens,
                    help="tokens per request")
    sz.add_argument("--concurrent", type=_positive_int("--concurrent"), default=8, help="requests held at once")
    sz.add_argument("--budget", type=_positive_int("--budget"), default=SelectionConfig.budget)
    sz.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    _setting_flag(sz, "kv_dtype")
    _setting_flag(sz, "score_dtype", IceCacheConfig.score_dtype)
    sz.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="run tritonserver with the icekv model until SIGINT/SIGTERM")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    serve.add_argument("--http-port", type=_positive_int("--http-port"), default=8000,
                       help="Triton's generate API and health routes (and the OpenAI API), served by icekv's "
                            "frontend with bounded bodies; tritonserver's own HTTP stays on loopback")
    serve.add_argument("--grpc-port", type=_positive_int("--grpc-port"), default=None,
                       help=f"Triton's gRPC API (default: {TRITON_GRPC_PORT}; not with --router)")
    serve.add_argument("--metrics-port", type=_positive_int("--metrics-port"), default=None,
                       help=f"Triton's metrics (default: {TRITON_METRICS_PORT}; not with --router)")
    serve.add_argument("--openai-port", type=_positive_int("--openai-port"), default=None,
                       help="also listen on this port (the OpenAI API's usual place; it serves /v1 and /v2)")
    serve.add_argument("--idle-timeout-s", type=_timeout("--idle-timeout-s"),
                       default=OpenAIConfig.idle_timeout_s,
                       help="cancel a request after this many seconds without output (its first piece: queueing and "
                            "prefill included); a reply runs for as long as its pieces keep coming")
    serve.add_argument("--request-timeout-s", type=_timeout("--request-timeout-s"),
                       default=OpenAIConfig.request_timeout_s,
                       help="cancel a request that runs longer than this in all (default: no limit)")
    serve.add_argument("--model-repository", type=Path, default=None,
                       help="serve this repository as is (default: generate one from the flags below)")
    serve.add_argument("--replicas", type=_positive_int("--replicas"), default=1,
                       help="icekv servers on loopback ports behind the router (needs --router when above 1)")
    serve.add_argument("--router", choices=ROUTER_POLICIES, default=None,
                       help="serve the OpenAI API on --http-port through the SGLang Model Gateway (sglang-router) "
                            "with this policy; cache_aware sends a conversation's turns to the replica holding "
                            "its prefix")
    _serving_flags(serve)

    build = sub.add_parser("build", help="TensorRT engines of the decode step (or --ptx-only: the plugins' kernels)")
    build.add_argument("--out", type=Path, required=True, help="directory for the engines / PTX")
    _model_flag(build, "whose shapes to build for")
    build.add_argument("--num-heads", type=_positive_int("--num-heads"), default=None, help="override the model's")
    build.add_argument("--num-kv-heads", type=_positive_int("--num-kv-heads"), default=None, help="override the model's")
    build.add_argument("--head-dim", type=_positive_int("--head-dim"), default=None, help="override the model's")
    build.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    build.add_argument("--budget", type=_positive_int("--budget"), default=SelectionConfig.budget,
                       help="tokens attended per KV head")
    build.add_argument("--page-size", type=_positive_int("--page-size"), default=PagingConfig.page_size)
    build.add_argument("--max-context", type=_positive_int("--max-context"), default=PagingConfig.pool_tokens,
                       help="longest context of one request: sets the candidate pages page_select accepts")
    build.add_argument("--max-batch", type=_positive_int("--max-batch"), default=8)
    build.add_argument("--arch", type=_positive_int("--arch"), default=90, help="CUDA compute capability, e.g. 90 = sm_90")
    build.add_argument("--ptx-only", action="store_true", help="write the kernels' PTX + kernels.json; no TensorRT needed")

    demo = sub.add_parser("demo", help="serve with Triton and stream a needle answer over a long context")
    demo.add_argument("--length", type=_positive_int("--length"), default=3000, help="prompt tokens")
    demo.add_argument("--seed", type=int, default=0)
    _serving_flags(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from icekv.devices import use_huge_pages

    use_huge_pages()  # before the first tensor
    parser = build_parser()
    args = parser.parse_args(argv)
    from icekv.cli.build import _cmd_build
    from icekv.cli.compress import _cmd_compress
    from icekv.cli.fidelity import _cmd_fidelity
    from icekv.cli.bench import _cmd_bench
    from icekv.cli.measure import _cmd_eval, _cmd_size
    from icekv.cli.run import _cmd_demo, _cmd_fetch, _cmd_generate, _cmd_serve

    handlers = {"fetch": _cmd_fetch, "generate": _cmd_generate, "demo": _cmd_demo, "eval": _cmd_eval,
                "serve": _cmd_serve, "compress": _cmd_compress, "size": _cmd_size,
                "bench": _cmd_bench, "build": _cmd_build, "fidelity": _cmd_fidelity}
    try:
        return handlers[args.command](args)
    except IcekvError as e:
        print(f"icekv: error: {e}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main", "_serving_parameters"]
