"""Each request field is declared once (icekv.serving.fields): the Triton inputs, the OpenAI
bodies' icekv extras, the parser's names and the docs' table follow the declaration."""

import json
from pathlib import Path

import pytest

from icekv.serving.fields import FIELDS, OPENAI_EXTRAS, docs_table
from icekv.serving.openai.protocol import ChatCompletionBody, CompletionBody, OpenAIError, parse_body
from icekv.serving.repository import INPUTS, render_config
from icekv.serving.request import INPUT_NAMES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_the_triton_inputs_and_the_parser_take_every_declared_field():
    assert [name for name, *_ in INPUTS] == [f.name for f in FIELDS]
    config = render_config()
    assert all(f'name: "{f.name}" data_type: {f.triton_type} dims: {f.dims}' in config for f in FIELDS)
    assert INPUT_NAMES == {f.name for f in FIELDS} - {"health"}


def test_the_docs_table_is_the_declaration():
    assert docs_table() in DOCS.read_text(), "docs/serving.md's inputs differ: paste icekv.serving.fields.docs_table()"


@pytest.mark.parametrize("body", [ChatCompletionBody, CompletionBody])
def test_every_icekv_extra_rides_along_in_both_openai_bodies_and_reaches_triton(body):
    sent = {"policy": "quest", "budget": 128, "context_key": "k" * 64, "context": "doc", "kv_method": "kv2",
            "kv_budget": 0.25, "cache_prompt": False, "cache_retention_s": 5.0, "repetition_penalty": 1.1}
    assert set(sent) == {f.name for f in OPENAI_EXTRAS}  # a new extra needs a value here
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if body is ChatCompletionBody else {"prompt": "hi"}
    fields = body.model_validate({"model": "icekv", **prompt, **sent}).triton_fields()
    assert {k: fields[k] for k in sent} == sent


@pytest.mark.parametrize("extra, value", [("budget", 0), ("kv_budget", 1.5), ("cache_retention_s", -1),
                                          ("repetition_penalty", 0), ("policy", 3)])
def test_the_openai_bodies_hold_the_declared_bounds(extra, value):
    with pytest.raises(OpenAIError) as e:
        parse_body(CompletionBody, json.dumps({"model": "icekv", "prompt": "hi", extra: value}), max_stop=4)
    assert e.value.status == 400 and e.value.param == extra
