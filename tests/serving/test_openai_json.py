"""JSON mode and JSON schemas (OpenAI's ``response_format``) through the official client and
Triton's generate extension, against a real tritonserver: outputs parse and satisfy the schema on
every seed tried, streamed too; schemas that cannot be compiled get OpenAI-shaped 400s naming the
problem, and the server keeps serving."""

import json

import openai
import pytest

from tests.serving.conftest import post

pytestmark = [pytest.mark.server, pytest.mark.model]
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]
PLACE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                          "country": {"type": "string", "maxLength": 30},
                                          "rank": {"type": "integer", "minimum": 1, "maximum": 100}},
         "required": ["name", "country", "rank"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _satisfies_place(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "country", "rank"}
    assert isinstance(value["name"], str) and isinstance(value["country"], str)
    assert isinstance(value["rank"], int) and 1 <= value["rank"] <= 100


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_outputs_satisfy_the_schema(client, seed):
    reply = client.chat.completions.create(model="icekv", messages=ASK, max_tokens=80, temperature=1.0, seed=seed,
                                           response_format=SCHEMA_FORMAT)
    _satisfies_place(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop"


def test_a_schema_streamed_and_json_mode_on_completions(client):
    chunks = client.chat.completions.create(model="icekv", messages=ASK, max_tokens=80, stream=True,
                                            response_format=SCHEMA_FORMAT)
    _satisfies_place("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    # JSON mode bounds nothing: a prompt that shows the small model an object, and room to end it
    prompt = 'Paris as JSON: {"name": "Paris", "country": "France"}\nBerlin as JSON:'
    done = client.completions.create(model="icekv", prompt=prompt, max_tokens=200,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop", done.choices[0].text
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_the_generate_extension_takes_a_schema(server):
    status, body = post(server, "/v2/models/icekv/generate",
                        {"text_input": "Describe Paris as JSON.", "max_tokens": 80, "json_schema": json.dumps(PLACE)})
    assert status == 200, body
    _satisfies_place(body["text_output"])


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "cannot be compiled"),
    ({"type": "json_schema"}, "json_schema is required"),
    ({"type": "xml"}, "response_format"),
])
def test_bad_schemas_get_400s_and_the_server_keeps_serving(client, response_format, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="icekv", messages=ASK, max_tokens=8, response_format=response_format)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert message in error["message"] and "Traceback" not in error["message"]
    assert client.chat.completions.create(model="icekv", messages=ASK, max_tokens=4).choices[0].message.content
