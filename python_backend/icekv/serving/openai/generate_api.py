"""Triton's generate extension served by the frontend: ``POST /v2/models/<model>/generate`` and
``generate_stream``, with the health and model-readiness routes a load balancer probes.

Requests go to the Triton model over the frontend's gRPC bridge, so ``icekv serve`` keeps
tritonserver's own HTTP port on loopback: every body is size-checked before it is read
(tritonserver 2.51 dies on a generate body past about 4 MiB), and the inputs are type-checked here
with a 400 that names the field. Bodies, responses and errors have the shapes of Triton's own
endpoints: inputs as top-level keys (or in ``parameters``), outputs as scalars, ``{"error": ...}``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from icekv.serving.client import Final
from icekv.serving.openai.protocol import OpenAIError
from icekv.serving.repository import INPUTS
from icekv.json_text import JSONTextError, read_json

_JSON_TYPES = {"TYPE_STRING": (str,), "TYPE_INT32": (int,), "TYPE_INT64": (int,), "TYPE_FP32": (int, float),
               "TYPE_BOOL": (bool,)}
FLOAT32_MAX = 3.4028234663852886e38
# the least and most value of each numeric type (a float32's bounds keep out inf and NaN)
_BOUNDS = {"TYPE_INT32": (-(2**31), 2**31 - 1), "TYPE_INT64": (-(2**63), 2**63 - 1),
           "TYPE_FP32": (-FLOAT32_MAX, FLOAT32_MAX)}
_TYPE_NAMES = {"TYPE_STRING": "a string", "TYPE_INT32": "an int32", "TYPE_INT64": "an int64",
               "TYPE_FP32": "a finite float32 number", "TYPE_BOOL": "true or false"}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _check(name: str, value: Any, ttype: str, dims: str) -> Any:
    """``value`` if it is what input ``name`` takes (one value, or a list where dims are [ -1 ])."""
    values = value if isinstance(value, list) and "-1" in dims else [value]
    for v in values:
        kinds = _JSON_TYPES[ttype]
        wrong = not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)
        if wrong or (ttype in _BOUNDS and not _BOUNDS[ttype][0] <= v <= _BOUNDS[ttype][1]):
            raise OpenAIError(400, f"input {name} must be {_TYPE_NAMES[ttype]}"
                              + (" or a list of them" if "-1" in dims else "") + f", got {json.dumps(v)[:40]}")
    return value


def input_schema(ttype: str, dims: str) -> dict[str, Any]:
    """The JSON schema of what :func:`_check` accepts for an input of ``ttype`` and ``dims`` (its
    types and bounds from the same tables)."""
    one: dict[str, Any] = {"TYPE_STRING": {"type": "string"}, "TYPE_FP32": {"type": "number"},
                           "TYPE_BOOL": {"type": "boolean"}}.get(ttype, {"type": "integer"})
    if ttype in _BOUNDS:
        one = {**one, "minimum": _BOUNDS[ttype][0], "maximum": _BOUNDS[ttype][1]}
    return {"anyOf": [one, {"type": "array", "items": one}]} if "-1" in dims else one


def generate_fields(raw: bytes) -> dict[str, Any]:
    """The model inputs of a generate body (top-level keys win over ``parameters``), ``stream`` aside."""
    try:
        body = read_json(raw)
    except JSONTextError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    params = body.pop("parameters", {})
    if not isinstance(params, dict):
        raise OpenAIError(400, "parameters must be a JSON object")
    inputs = {name: (ttype, dims) for name, ttype, dims, _ in INPUTS}
    for where, keys in (("inputs", body), ("parameters", params)):
        unknown = sorted(set(keys) - set(inputs))
        if unknown:  # a misspelt setting would otherwise be dropped without a word
            raise OpenAIError(400, f"unknown {where} {unknown}; the model takes {sorted(inputs)}")
    # each place's values checked, so that an overridden value in parameters is refused, not dropped
    fields = {name: _check(name, value, *inputs[name]) for keys in (params, body) for name, value in keys.items()}
    fields.pop("stream", None)
    return fields


def _response(model: str, piece: str | Final) -> dict[str, Any]:
    out = {"model_name": model, "model_version": "1"}
    if isinstance(piece, Final):
        return {**out, "text_output": "", **vars(piece)}
    return {**out, "text_output": piece}


class GenerateAPI:
    """The routes, over the frontend's bridge and settings (``frontend.bridge``, ``frontend.config``)."""

    def __init__(self, frontend):
        self.frontend = frontend

    def routes(self) -> list[Route]:
        return [
            Route("/v2/models/{model}/generate", self.generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.generate_stream, methods=["POST"]),
            Route("/v2/models/{model}/ready", self.model_ready, methods=["GET"]),
            Route("/v2/health/ready", self.model_ready, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
        ]

    async def live(self, request: Request) -> Response:
        """Live while tritonserver answers and, once the model is loaded, its engine thread runs
        (a dead engine thread cannot recover: the pod should restart)."""
        bridge = self.frontend.bridge
        if not await bridge.live():
            return _error(503, "the inference server is not live")
        if await bridge.ready() and not await bridge.engine_alive():
            return _error(503, "the engine has stopped")
        return Response(status_code=200)

    async def model_ready(self, request: Request) -> Response:
        model = request.path_params.get("model", self.frontend.config.model)
        if model != self.frontend.config.model:
            return _error(404, f"unknown model {model!r}")
        bridge = self.frontend.bridge
        if await bridge.ready() and await bridge.engine_alive():
            return Response(status_code=200)
        return _error(503, f"model {model} is not ready")

    async def generate(self, request: Request) -> Response:
        try:
            pieces = await self._start(request)
            text, final = await self.frontend.collect_unless_disconnected(request, pieces)
        except OpenAIError as e:
            return _error(e.status, e.message)
        return JSONResponse({**_response(self.frontend.config.model, final), "text_output": text})

    async def generate_stream(self, request: Request) -> Response:
        try:
            pieces = await self._start(request)
            first = await self.frontend.first_unless_disconnected(request, pieces)
        except OpenAIError as e:
            return _error(e.status, e.message)
        return StreamingResponse(self._events(first, pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _start(self, request: Request) -> AsyncIterator:
        model = request.path_params["model"]
        if model != self.frontend.config.model:
            raise OpenAIError(404, f"unknown model {model!r}; this server serves {self.frontend.config.model!r}")
        raw = await self.frontend.read_body(request)
        fields = generate_fields(raw)  # streamed from Triton either way; generate joins the pieces
        return self.frontend.pieces({**fields, "stream": True})

    async def _events(self, first, pieces: AsyncIterator):
        """One event per piece, the last with the statistics; an error after the start as an event."""
        model = self.frontend.config.model
        try:
            piece = first
            while True:
                yield f"data: {json.dumps(_response(model, piece), ensure_ascii=False)}\n\n"
                if isinstance(piece, Final):
                    return
                piece = await anext(pieces)
        except OpenAIError as e:
            yield f"data: {json.dumps({'error': e.message})}\n\n"
        finally:
            await pieces.aclose()
