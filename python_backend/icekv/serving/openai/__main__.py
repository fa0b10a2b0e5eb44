"""``python -m icekv.serving.openai``: run the frontend with uvicorn (``icekv serve --openai-port`` starts it)."""

from __future__ import annotations

import argparse
import sys

from icekv.serving.openai.config import OpenAIConfig
from icekv.errors import IcekvError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m icekv.serving.openai", description=__doc__)
    parser.add_argument("--triton-grpc-url", default=OpenAIConfig.triton_grpc_url)
    parser.add_argument("--triton-metrics-url", default=OpenAIConfig.triton_metrics_url,
                        help="Triton's metrics URL: served again at /metrics, with vLLM's names for routers")
    parser.add_argument("--model", default=OpenAIConfig.model, help="the Triton model, and the id clients send")
    parser.add_argument("--host", default=OpenAIConfig.host)
    parser.add_argument("--port", type=int, default=OpenAIConfig.port)
    parser.add_argument("--extra-port", type=int, action="append", default=[], help="another port, same routes")
    parser.add_argument("--max-body-bytes", type=int, default=OpenAIConfig.max_body_bytes)
    parser.add_argument("--idle-timeout-s", type=float, default=OpenAIConfig.idle_timeout_s)
    parser.add_argument("--request-timeout-s", type=float, default=OpenAIConfig.request_timeout_s)
    args = parser.parse_args(argv)
    try:
        config = OpenAIConfig(triton_grpc_url=args.triton_grpc_url, triton_metrics_url=args.triton_metrics_url,
                              model=args.model, host=args.host, port=args.port,
                              extra_ports=tuple(args.extra_port), max_body_bytes=args.max_body_bytes,
                              idle_timeout_s=args.idle_timeout_s, request_timeout_s=args.request_timeout_s)
    except IcekvError as e:
        print(f"icekv openai frontend: error: {e}", file=sys.stderr)
        return 2
    import asyncio
    import socket

    import uvicorn

    from icekv.serving.openai.app import create_app

    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        sockets = [socket.create_server((config.host, port), family=family)
                   for port in (config.port, *config.extra_ports)]
    except OSError as e:
        print(f"icekv openai frontend: error: cannot listen on {config.host}: {e.strerror}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning", timeout_graceful_shutdown=5,
                                           server_header=False))
    asyncio.run(server.serve(sockets=sockets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
