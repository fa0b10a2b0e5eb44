"""icekv's HTTP frontend (Starlette), forwarding every request to the icekv Triton model over gRPC.

The OpenAI-compatible API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (server-sent
events when ``stream`` is true), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Triton's,
and the load under vLLM's names for routers: :mod:`icekv.serving.openai.engine_metrics`), every
error OpenAI-shaped; the OpenAPI description of every route at ``GET /openapi.json``; and
Triton's generate extension (:mod:`icekv.serving.openai.generate_api`). A client that
disconnects, streaming or not, cancels its Triton request.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.engine_metrics import vllm_exposition
from icekv.serving.client import Final
from icekv.serving.openai.generate_api import GenerateAPI
from icekv.serving.openai.openapi import openapi_document
from icekv.serving.openai.shapes import Kind, ToolDeltas, answer_calls, called, final_logprobs, icekv_stats, usage
from icekv.serving.openai.streams import gather_closing, merged, starting_with
from icekv.serving.openai.protocol import ChatCompletionBody, CompletionBody, OpenAIError, parse_body
from icekv.serving.openai.triton_bridge import TritonBridge
from icekv.serving.tool_formats import FORMATS, HERMES, ToolFormat


METRICS_WAIT_S = 5.0  # the longest wait for Triton's metrics
METRICS_MAX_AGE_S = 0.2  # Triton's metrics are read again after this (endpoint pickers poll every 50 ms)


def _read_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    return _error_response(error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    path = request.url.path
    message = {404: f"no route {path}", 405: f"{request.method} is not allowed on {path}"}
    return _error_response(OpenAIError(error.status_code, message.get(error.status_code, str(error.detail))))


async def _client_gone(request: Request, error: ClientDisconnect) -> Response:
    return Response(status_code=499)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 past ``limit`` bytes (before reading it when the length is declared)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise OpenAIError(413, f"the request body exceeds this server's limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise OpenAIError(413, f"the request body exceeds this server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable):
    """``awaitable``'s result, or OpenAIError(499) if the client hangs up first (``awaitable`` is cancelled)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
    finally:
        watch.cancel()
        work.cancel()
    await asyncio.gather(work, return_exceptions=True)  # let the cancellation run (it cancels the gRPC call)
    raise OpenAIError(499, "the client closed the request")


class OpenAIFrontend:
    """The app's state: its settings and one Triton client."""

    def __init__(self, config: OpenAIConfig):
        self.config = config
        self.bridge: TritonBridge | None = None
        self.calls_format: ToolFormat | None = None  # how the model writes tool calls: its last health answer's
        self._triton_metrics = (-math.inf, "")  # (when read, monotonic; the text)

    @asynccontextmanager
    async def lifespan(self, app):
        self.bridge = TritonBridge(self.config.triton_grpc_url, self.config.model)
        try:
            yield
        finally:
            await self.bridge.close()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            *([Route("/metrics", self.metrics, methods=["GET"])] if self.config.triton_metrics_url else []),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *GenerateAPI(self).routes(),
        ]
        handlers = {OpenAIError: _openai_error, HTTPException: _http_error, ClientDisconnect: _client_gone}
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=self.lifespan)

    # ---- routes
    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "icekv"}]})

    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(openapi_document(self.config.model, self.config.triton_metrics_url is not None))

    async def health(self, request: Request) -> JSONResponse:
        if await self.bridge.ready() and await self._ask_health():
            return JSONResponse({"status": "ok"})
        return _error_response(OpenAIError(503, f"the Triton model {self.config.model} is not ready"))

    async def metrics(self, request: Request) -> Response:
        """Triton's metrics (icekv's own among them), then the same load under vLLM's names."""
        read_at, text = self._triton_metrics
        if time.monotonic() - read_at > METRICS_MAX_AGE_S:
            try:
                text = await asyncio.to_thread(_read_text, self.config.triton_metrics_url, METRICS_WAIT_S)
            except OSError:
                raise OpenAIError(503, "the inference server's metrics are not reachable") from None
            self._triton_metrics = (time.monotonic(), text)
        return Response(text.rstrip("\n") + "\n" + vllm_exposition(text, self.config.model),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionBody, Kind(chat=True))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionBody, Kind(chat=False))

    # ---- shared by both APIs
    async def read_body(self, request: Request) -> bytes:
        return await _read_body(request, self.config.max_body_bytes)

    def pieces(self, fields: dict) -> AsyncIterator:
        """One Triton request's text pieces, then its Final, within the request timeout."""
        return self._timed(self.bridge.generate(fields))

    async def collect_unless_disconnected(self, request: Request, pieces: AsyncIterator) -> tuple[str, Final]:
        return await _unless_disconnected(request, self._collect(pieces))

    async def first_unless_disconnected(self, request: Request, pieces: AsyncIterator):
        """The first piece: a refused request then gets its status code, not a 200 stream."""
        return await _unless_disconnected(request, anext(pieces))

    # ---- generation
    async def _generate(self, request: Request, body_model, kind: Kind) -> Response:
        raw = await self.read_body(request)
        body = parse_body(body_model, raw, self.config.max_stop_sequences)
        if body.model != self.config.model:
            raise OpenAIError(404, f"the model {body.model!r} does not exist; this server serves "
                              f"{self.config.model!r}", "model", "model_not_found")
        meta = {"id": f"{kind.prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.config.model}
        wants_logprobs = body.top_logprobs_asked is not None
        calls_format = await self._tool_format() if kind.chat and body.calls_tools else None
        # each prompt's first choice, up to its first piece: a refused request gets its status code
        # (not a 200 stream), and the prompt is prefilled, its pages in the prefix cache for the
        # prompt's other choices to share
        step = body.n if body.shares_prompt else 1  # a choice that cannot share its prompt's pages starts at once
        leaders = {i: self.pieces(body.choice_fields(i)) for i in range(0, body.choice_count, step)}
        try:
            firsts = await _unless_disconnected(request, gather_closing(anext(s) for s in leaders.values()))
        except BaseException:  # one refused, or the client gone: the others' requests end too
            await asyncio.gather(*(s.aclose() for s in leaders.values()), return_exceptions=True)
            raise
        streams = [starting_with(firsts[i // step], leaders[i]) if i in leaders else self.pieces(body.choice_fields(i))
                   for i in range(body.choice_count)]
        if not body.stream:
            results = await _unless_disconnected(request, gather_closing(self._collect(s) for s in streams))
            choices = [self._choice(kind, body, i, text, final, wants_logprobs, calls_format)
                       for i, (text, final) in enumerate(results)]
            finals = [final for _, final in results]
            return JSONResponse({**meta, "object": kind.object, "choices": choices,
                                 "usage": usage(finals, body.n), "icekv": icekv_stats(finals[0])})
        return StreamingResponse(self._events(streams, meta, kind, body, wants_logprobs, calls_format),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _ask_health(self) -> bool:
        """Whether the model answers a health request; its answer's tool-call format is kept (a
        server that names none reads calls as Hermes)."""
        final = await self.bridge.health()
        if final is not None:
            self.calls_format = FORMATS.get(final.tool_format, HERMES)
        return final is not None

    async def _tool_format(self) -> ToolFormat:
        """How the model writes tool calls: known from its last health answer, asked for the first time here."""
        if self.calls_format is None and not await self._ask_health():
            raise OpenAIError(503, f"the Triton model {self.config.model} is not ready")
        return self.calls_format

    @staticmethod
    def _choice(kind: Kind, body, index: int, text: str, final: Final, wants_logprobs: bool,
                calls_format: ToolFormat | None) -> dict:
        """``calls_format``: the model's tool-call format, where the answer's calls are read (a chat with tools)."""
        logprobs = final_logprobs(final, body.echoes_prompt) if wants_logprobs else None
        if calls_format is not None:
            content, calls = answer_calls(text, calls_format, body.tool_names, body.parallel_calls)
            return kind.choice(index, content, final.finish_reason, logprobs, calls)
        return kind.choice(index, body.echoed(index) + text, final.finish_reason, logprobs)

    async def _timed(self, pieces: AsyncIterator) -> AsyncIterator:
        """``pieces`` for as long as they keep coming: at most ``idle_timeout_s`` without one (from
        the request's start to its first piece, then between any two), and within
        ``request_timeout_s`` in all where one is set. Running out cancels the gRPC call, and with
        it the request in the engine.

        Per-piece waits, not ``asyncio.timeout``: a streamed response's first piece and the rest
        are awaited from different tasks."""
        loop = asyncio.get_running_loop()
        idle, total = self.config.idle_timeout_s, self.config.request_timeout_s
        deadline = None if total is None else loop.time() + total
        try:
            while True:
                left = math.inf if deadline is None else max(deadline - loop.time(), 0.0)
                try:
                    piece = await asyncio.wait_for(anext(pieces), min(idle, left))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if left <= idle:
                        raise OpenAIError(504, f"the request took longer than {total:g} s (request_timeout_s); "
                                          "it was cancelled") from None
                    raise OpenAIError(504, f"no output for {idle:g} s (idle_timeout_s, the longest wait for the "
                                      "next piece, the first one's queueing and prefill included); the request was "
                                      "cancelled") from None
                yield piece
        finally:
            await pieces.aclose()

    @staticmethod
    async def _collect(pieces: AsyncIterator) -> tuple[str, Final]:
        text = []
        async for piece in pieces:
            if isinstance(piece, Final):
                return "".join(text), piece
            text.append(piece)
        raise OpenAIError(500, "the inference server ended the request without a result")

    async def _events(self, streams: list[AsyncIterator], meta: dict, kind: Kind, body, wants_logprobs: bool,
                      calls_format: ToolFormat | None):
        """Server-sent events: each choice's chunks as they come, then usage if asked, then
        ``[DONE]``; an error mid-stream as an event. Log-probabilities, when asked, come whole with
        a choice's finishing chunk (a streamed piece of text need not end on a token)."""

        def event(choices: list, **extra) -> str:
            chunk = {**meta, "object": kind.chunk_object, "choices": choices, **extra}
            if body.include_usage:
                chunk.setdefault("usage", None)
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        finals: dict[int, Final] = {}
        calls = [None if calls_format is None else ToolDeltas(calls_format, body.tool_names, body.parallel_calls)
                 for _ in streams]

        def deltas(i: int, parts: list) -> list[str]:  # a choice's content pieces and tool call entries
            return [event([kind.delta(i, None, None, calls=p) if isinstance(p, dict) else kind.delta(i, p, None)])
                    for p in parts if p]

        stream = merged(streams)
        try:
            if kind.chat:
                for i in range(len(streams)):
                    yield event([kind.delta(i, None, None, first=True)])
            for i in range(len(streams) if body.echoes_prompt else 0):
                yield event([kind.delta(i, body.echoed(i), None)])
            async for i, piece in stream:
                if isinstance(piece, Final):
                    finals[i] = piece
                    for chunk in deltas(i, calls[i].finish() if calls[i] else []):
                        yield chunk
                    logprobs = final_logprobs(piece, body.echoes_prompt) if wants_logprobs else None
                    reason = called(piece.finish_reason, bool(calls[i] and calls[i].calls))
                    yield event([kind.delta(i, None, reason, logprobs=logprobs)], icekv=icekv_stats(piece))
                elif piece:
                    for chunk in deltas(i, calls[i].feed(piece) if calls[i] else [piece]):
                        yield chunk
            if body.include_usage:
                yield event([], usage=usage([finals[i] for i in sorted(finals)], body.n))
        except OpenAIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"


def create_app(config: OpenAIConfig = OpenAIConfig()) -> Starlette:
    return OpenAIFrontend(config).app()
