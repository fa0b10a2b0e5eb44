"""`icekv fetch`, `generate`, `demo`, `serve`: running the model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from icekv.errors import IcekvError
from icekv.cli.common import TRITON_GRPC_PORT, TRITON_METRICS_PORT
from icekv.cli.common import _device_settings, _icecache_config, _kv_dtype, _open_store, _serving_parameters


def _cmd_fetch(args) -> int:
    from icekv.assets import Assets

    assets = Assets()
    getters = {"model": lambda: assets.model_dir(args.model), "essays": assets.essays_dir,
               "kjv": lambda: assets.kjv_path().parent}
    for name, get in getters.items():
        if not args.list and args.what in ("all", name):
            path = get()
            if args.verify:
                assets.verify(path)
            print(f"{name}: {path}")
    print(_known_models_table(assets))
    return 0


def _known_models_table(assets) -> str:
    from icekv.registry import DEFAULT_MODEL, KNOWN_MODELS

    rows = [("name", "fetched", "context", "license", "chat template", "what")]
    rows += [(m.name + (" (default)" if m.name == DEFAULT_MODEL else ""), "yes" if assets.is_fetched(m.name) else "no",
              f"{m.trained_context:,}", m.license, m.chat_template, m.architecture) for m in KNOWN_MODELS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["known models (--model NAME; icekv fetch --model NAME fetches one):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    return "\n".join(lines)


def _cmd_generate(args) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from icekv.config.engine import EngineConfig
    from icekv.config.paging import PagingConfig
    from icekv.config.request import SamplingConfig
    from icekv.config.selection import SelectionConfig
    from icekv.engine import Engine

    if args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise IcekvError(f"--prompt-file {args.prompt_file} is not a readable file")
        prompt = args.prompt_file.read_text()
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise IcekvError("the prompt is empty (--prompt / --prompt-file)")
    paging = PagingConfig(kv_dtype=_kv_dtype(args))
    if args.page_size is not None:
        paging = replace(paging, page_size=args.page_size)
    if args.pool_tokens is not None:
        paging = replace(paging, pool_tokens=args.pool_tokens)
    sampling = SamplingConfig(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    selection = SelectionConfig(policy=args.policy, budget=args.budget, page_size=paging.page_size,
                                icecache=_icecache_config(args))
    engine = Engine(EngineConfig(model_dir=args.model, paging=paging, selection=selection, **_device_settings(args)))
    if args.chat:
        prompt = engine.chat_prompt([{"role": "user", "content": prompt}])
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
    from icekv.serving.openai.config import OpenAIConfig
    from icekv.engine.model_dir import resolve_model_dir
    from icekv.eval.tasks import HaystackSampler
    from icekv.model import Tokenizer
    from icekv.serving.client import Final, stream_generate
    from icekv.serving.launcher import TritonServer, free_port
    from icekv.serving.openai.process import OpenAIFrontendProcess

    params = _serving_parameters(args, served_here=True)
    assets = Assets()
    model_dir = resolve_model_dir(args.model)
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
        print(f"\nexpected: {sample.question.answers[0]} -> {verdict}")
        print(
            f"policy {final.policy} (budget {final.budget} tokens per layer per KV head): "
            f"{final.prompt_tokens} prompt + {final.new_tokens} new tokens; KV cache "
            f"{final.kv_resident_bytes / 2**20:.1f} MiB resident on the device of "
            f"{final.kv_total_bytes / 2**20:.1f} MiB in the host pool, {final.kv_bytes_moved / 2**20:.1f} MiB moved"
        )
        with OpenAIFrontendProcess(OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port())) as frontend:
            _chat_turn(frontend.url)
    return 0


def _chat_turn(url: str) -> None:
    """One chat turn through the OpenAI-compatible API with the official client, streamed."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    question = "What is the capital of France? Answer in one sentence."
    print(f"\nOpenAI API at {url}/v1, chat template applied by the server")
    print(f"user: {question}\nassistant:", end=" ", flush=True)
    stream = client.chat.completions.create(model="icekv", messages=[{"role": "user", "content": question}],
                                            max_tokens=32, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def _cmd_serve(args) -> int:
    import signal
    import threading

    params = _serving_parameters(args, served_here=True)
    if args.model_repository is not None and params:
        raise IcekvError("--model-repository is served as is: set parameters in its config.pbtxt, not with flags")
    if args.replicas > 1 and args.router is None:
        raise IcekvError("--replicas above 1 needs --router (the SGLang Model Gateway picks each request's replica)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.router is not None:
        return _serve_replicas(args, params, stop)
    return _serve_one(args, params, stop)


def _serve_one(args, params: dict, stop) -> int:
    from icekv.serving.openai.config import OpenAIConfig
    from icekv.serving.launcher import TritonServer
    from icekv.serving.openai.process import OpenAIFrontendProcess

    if args.openai_port is not None and args.openai_port == args.http_port:
        raise IcekvError("--openai-port and --http-port must differ (the HTTP port serves both APIs already)")
    # Triton's own HTTP stays on loopback: clients reach its generate API through icekv's frontend
    # on --http-port, which bounds every body (tritonserver dies on a generate body past ~4 MiB)
    server = TritonServer(params, args.model_repository, args.host, http_host="127.0.0.1",
                          grpc_port=args.grpc_port or TRITON_GRPC_PORT,
                          metrics_port=args.metrics_port or TRITON_METRICS_PORT)
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    frontend = OpenAIFrontendProcess(OpenAIConfig(
        triton_grpc_url=f"{local}:{server.grpc_port}",
        triton_metrics_url=f"http://{local}:{server.metrics_port}/metrics",
        host=args.host, port=args.http_port, extra_ports=(args.openai_port,) if args.openai_port is not None else (),
        idle_timeout_s=args.idle_timeout_s, request_timeout_s=args.request_timeout_s))
    try:
        server.start()
        frontend.start()
        where = f"HTTP {args.host}:{args.http_port}, gRPC {server.grpc_url}, metrics {server.metrics_url}"
        if args.openai_port is not None:
            where += f", OpenAI API http://{args.host}:{args.openai_port}/v1"
        print(f"icekv serving: {where}", file=sys.stderr)
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                raise IcekvError(f"tritonserver exited with {server.process.returncode}:\n{server.log_tail()}")
            if frontend.process.poll() is not None:
                raise IcekvError(f"the HTTP frontend exited with {frontend.process.returncode}")
    finally:
        frontend.stop()
        server.stop()
    return 0


def _serve_replicas(args, params: dict, stop) -> int:
    """``--replicas N --router POLICY``: N servers on loopback and the router on --http-port. A
    replica that exits is reported and started again on its port (``ReplicaSupervisor``); the
    router's health check leaves it out meanwhile."""
    from icekv.serving.replicas import Replica, ReplicaSupervisor, RouterProcess

    for flag, value in (("--openai-port", args.openai_port), ("--grpc-port", args.grpc_port),
                        ("--metrics-port", args.metrics_port), ("--model-repository", args.model_repository)):
        if value is not None:
            raise IcekvError(f"{flag} is not used with --router: each replica takes free loopback ports, the "
                             "router serves the OpenAI API on --http-port")
    if params.get("kv_events_endpoint"):
        raise IcekvError("--kv-events-endpoint is not used with --router: the gateway routes by what it has sent "
                         "each replica; run the replicas one by one for a router that reads page events")
    replicas = [Replica(params, args.idle_timeout_s, args.request_timeout_s, index=i) for i in range(args.replicas)]
    supervisor = ReplicaSupervisor(replicas)
    router = None
    try:
        for replica in replicas:
            replica.start()
        router = RouterProcess(tuple(r.url for r in replicas), args.router, args.host, args.http_port).start()
        urls = ", ".join(r.url for r in replicas)
        print(f"icekv serving: OpenAI API http://{args.host}:{args.http_port}/v1 through the SGLang Model Gateway "
              f"({args.router}) over {args.replicas} replicas: {urls}", file=sys.stderr)
        while not stop.wait(1.0):
            if router.process.poll() is not None:
                raise IcekvError(f"the router exited with {router.process.returncode}:\n{router.log_tail()}")
            for event in supervisor.poll():
                print(f"icekv: {event}; {supervisor.serving} of {len(replicas)} serving", file=sys.stderr)
    finally:
        if router is not None:
            router.stop()
        supervisor.close()
    return 0
