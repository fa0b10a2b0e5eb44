"""The OpenAPI description of what the frontend serves (``GET /openapi.json``), generated from the
models that validate the bodies, never written apart from them: the OpenAI bodies' schemas are
their pydantic models' own, the generate body's comes from the Triton model's inputs
(:data:`icekv.serving.repository.INPUTS`) with the types and bounds the frontend checks them by. Each
operation lists every status it can answer, with the error body of its family (OpenAI's
``{"error": {"message", ...}}`` or Triton's ``{"error": "..."}``): what schema-driven fuzzers
hold the server to.
"""

from __future__ import annotations

from typing import Any

from icekv import __version__
from icekv.serving.openai.generate_api import input_schema
from icekv.serving.openai.protocol import ChatCompletionBody, CompletionBody, OpenAIError
from icekv.serving.repository import INPUTS

REF = "#/components/schemas/{model}"
JSON = "application/json"
EVENTS = "text/event-stream"

OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
TRITON_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
              "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                             "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}},
                             "usage": {"type": "object"}}}
GENERATED = {"type": "object", "required": ["model_name", "model_version", "text_output"],
             "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                            "text_output": {"type": "string"}}}
EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}  # one server-sent event
MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object"], "properties": {"id": {"type": "string"}}}}}}

# what a generation can answer besides 200: a refused body, an unknown model, a body past the size
# limit, a client gone, a result missing, a busy or stalled model, a deadline passed
GENERATION_ERRORS = (400, 404, 413, 499, 500, 503, 504)


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(statuses: tuple[int, ...], schema: dict[str, Any]) -> dict[str, Any]:
    return {str(s): _json(schema, OpenAIError.TYPES.get(s, "error")) for s in statuses}


def _generate_body() -> dict[str, Any]:
    """The generate extension's body: the model's inputs as top-level keys, or in ``parameters``."""
    inputs = {name: input_schema(ttype, dims) for name, ttype, dims, _ in INPUTS}
    parameters = {"type": "object", "properties": inputs, "additionalProperties": False}
    return {"type": "object", "properties": {**inputs, "parameters": parameters}, "additionalProperties": False}


def openapi_document(model: str, serves_metrics: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a frontend serving ``model`` (and ``/metrics`` if it does)."""
    schemas: dict[str, Any] = {}

    def body(cls) -> dict[str, Any]:
        schema = cls.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[cls.__name__] = schema
        return {"required": True, "content": {JSON: {"schema": {"$ref": REF.format(model=cls.__name__)}}}}

    def generation(cls, summary: str) -> dict[str, Any]:
        ok = {"description": "the completion, or with stream: true its server-sent events",
              "content": {JSON: {"schema": COMPLETION}, EVENTS: {"schema": EVENT}}}
        return {"post": {"summary": summary, "requestBody": body(cls),
                         "responses": {"200": ok, **_errors(GENERATION_ERRORS, OPENAI_ERROR)}}}

    model_param = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    generate_ok = {"description": "the text, or its server-sent events",
                   "content": {JSON: {"schema": GENERATED}, EVENTS: {"schema": EVENT}}}
    generate = {"parameters": model_param,
                "requestBody": {"required": True, "content": {JSON: {"schema": _generate_body()}}},
                "responses": {"200": generate_ok, **_errors(GENERATION_ERRORS, TRITON_ERROR)}}
    probe = {"200": {"description": "ready"}, **_errors((503,), TRITON_ERROR)}
    paths = {
        "/v1/chat/completions": generation(ChatCompletionBody, "OpenAI chat completions"),
        "/v1/completions": generation(CompletionBody, "OpenAI completions"),
        "/v1/models": {"get": {"summary": "the served model", "responses": {"200": _json(MODELS, "the model list")}}},
        "/health": {"get": {"summary": "the model is loaded and its engine runs", "responses": {
            "200": _json({"type": "object", "required": ["status"]}, "ok"), **_errors((503,), OPENAI_ERROR)}}},
        "/openapi.json": {"get": {"summary": "this document", "responses": {
            "200": _json({"type": "object"}, "the OpenAPI document")}}},
        "/v2/models/{model}/generate": {"post": {"summary": "Triton's generate extension", **generate}},
        "/v2/models/{model}/generate_stream": {"post": {"summary": "generate, as server-sent events", **generate}},
        "/v2/models/{model}/ready": {"get": {"summary": "the model is ready", "parameters": model_param,
                                             "responses": {**probe, **_errors((404,), TRITON_ERROR)}}},
        "/v2/health/ready": {"get": {"summary": "the model is ready", "responses": probe}},
        "/v2/health/live": {"get": {"summary": "the server is live", "responses": probe}},
    }
    if serves_metrics:
        paths["/metrics"] = {"get": {"summary": "Triton's metrics, then the load under vLLM's names", "responses": {
            "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors((503,), OPENAI_ERROR)}}}
    return {"openapi": "3.1.0", "info": {"title": f"icekv serving {model}", "version": __version__},
            "paths": paths, "components": {"schemas": schemas}}
