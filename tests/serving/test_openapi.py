"""The frontend's OpenAPI description (``GET /openapi.json``): it names every route the app serves
and no other, and its body schemas agree with the frontend's own validation (bodies drawn from the
document by schemathesis: those it calls valid pass every type and bound the parser checks, only
the models' own validators refusing some; those it calls invalid never validate)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import schemathesis
from schemathesis import GenerationMode
from icekv.serving.openai.app import create_app
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.generate_api import generate_fields
from icekv.serving.openai.openapi import openapi_document
from icekv.serving.openai.protocol import ChatCompletionBody, CompletionBody, OpenAIError

FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _json_integer(err: dict) -> bool:
    """A float with no fraction where an integer is asked: JSON Schema's integer, refused as OpenAI
    refuses it ("expected an integer, but got a decimal number"); JSON Schema cannot tell them apart."""
    return err["type"] == "int_type" and isinstance(err["input"], float) and err["input"].is_integer()


def _raw(body) -> bytes:
    """The body as sent: JSON, unless the case is already bytes (a negative case may be no JSON)."""
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def _operation(path: str, method: str = "POST"):
    schema = schemathesis.openapi.from_dict(openapi_document("icekv"))
    return schema[path][method]


@pytest.mark.parametrize("metrics_url", [None, "http://127.0.0.1:8002/metrics"])
def test_the_document_names_every_served_route_and_only_those(metrics_url):
    app = create_app(OpenAIConfig(triton_metrics_url=metrics_url))
    served = {(route.path, method) for route in app.routes for method in route.methods - {"HEAD"}}
    paths = openapi_document("icekv", metrics_url is not None)["paths"]
    described = {(path, method.upper()) for path, operations in paths.items() for method in operations}
    assert served == described


def test_every_operation_documents_its_errors_with_the_family_s_body():
    paths = openapi_document("icekv", serves_metrics=True)["paths"]
    for path, operations in paths.items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    error = response["content"]["application/json"]["schema"]["properties"]["error"]
                    openai_shaped = path.startswith("/v1/") or path in ("/health", "/metrics")
                    assert error["type"] == ("object" if openai_shaped else "string")


@pytest.mark.parametrize("path,model", [("/v1/chat/completions", ChatCompletionBody),
                                        ("/v1/completions", CompletionBody)])
def test_a_body_the_document_allows_passes_every_type_and_bound_check(path, model):
    """Only the models' own validators (``value_error``: rules a JSON schema cannot state, such as
    top_logprobs without logprobs or a tool call's arguments being a JSON object) may refuse it,
    never a type or a bound: the document is no looser than the parser on those."""

    @FUZZ
    @given(case=_operation(path).as_strategy(GenerationMode.POSITIVE))
    def check(case):
        try:
            model.model_validate_json(_raw(case.body))
        except ValidationError as e:
            assert all(err["type"] == "value_error" or _json_integer(err) for err in e.errors()), e.errors()

    check()


@pytest.mark.parametrize("path,model", [("/v1/chat/completions", ChatCompletionBody),
                                        ("/v1/completions", CompletionBody)])
def test_a_body_the_document_refuses_is_refused(path, model):
    """The document is no stricter than the parser: what it calls invalid never validates."""

    @FUZZ
    @given(case=_operation(path).as_strategy(GenerationMode.NEGATIVE))
    def check(case):
        with pytest.raises(ValidationError):
            model.model_validate_json(_raw(case.body))

    check()


def test_the_generate_body_agrees_with_its_checks():
    operation = _operation("/v2/models/{model}/generate")

    @FUZZ
    @given(drawn=st.one_of(operation.as_strategy(GenerationMode.POSITIVE).map(lambda c: (True, c)),
                          operation.as_strategy(GenerationMode.NEGATIVE).map(lambda c: (False, c))))
    def check(drawn):
        valid, case = drawn
        raw = _raw(case.body)
        if valid:
            try:
                generate_fields(raw)
            except OpenAIError as e:  # only an integral float where an integer is asked
                assert e.status == 400 and "must be an int" in e.message and ".0" in e.message, e.message
        else:
            with pytest.raises(OpenAIError) as refused:
                generate_fields(raw)
            assert refused.value.status == 400

    check()


def test_a_parameter_overridden_by_a_top_level_input_is_still_checked():
    """Found by the generate body's fuzz: the overridden value was dropped unchecked."""
    with pytest.raises(OpenAIError, match="input budget must be an int32"):
        generate_fields(json.dumps({"budget": 8, "parameters": {"budget": -2**31 - 1}}).encode())
    assert generate_fields(json.dumps({"budget": 8, "parameters": {"budget": 16}}).encode()) == {"budget": 8}
