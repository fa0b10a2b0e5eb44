"""Request bodies that the property tests and fuzzers found to escape the frontend's checks, each
refused now with a 400 that names the field (never a 500)."""

import json

import pytest

from icekv.serving.openai.generate_api import generate_fields
from icekv.serving.openai.protocol import ChatCompletionBody, OpenAIError, parse_body


@pytest.mark.parametrize("arguments", ['{"a": ' + "[" * 5000 + "]" * 5000 + "}", '{"a": ' + "9" * 5000 + "}"])
def test_tool_call_arguments_nested_5000_deep_or_of_5000_digits(arguments):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"model": "icekv", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        parse_body(ChatCompletionBody, json.dumps(body).encode(), 4)


@pytest.mark.parametrize("body", [{"text_input": "hi \ud800 there"}, {"text_input": "x", "stop": ["a", "\udfff"]}])
def test_a_generate_input_with_a_lone_surrogate(body):
    with pytest.raises(OpenAIError, match="is not valid Unicode text") as refused:
        generate_fields(json.dumps(body).encode())  # json.dumps writes the surrogate as a \\ud800 escape
    assert refused.value.status == 400
    assert generate_fields(json.dumps({"text_input": "h\u00e9 \U0001f600"}).encode())["text_input"] == "hé 😀"
