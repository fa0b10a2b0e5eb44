"""Constrained decoding with the real model and tokenizer: every output under a JSON schema parses
and satisfies it, whatever the sampling seed; a schema that cannot be compiled is refused naming
the problem; the mask is what the grammar allows."""

import json

import pytest
import torch

from icekv.config.request import SamplingConfig
from icekv.engine.grammar import Grammars
from icekv.errors import ConfigError

pytestmark = pytest.mark.model

# bounded, so that an output ends within max_tokens (an unbounded integer may run on, as the model likes)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                         "coastal": {"type": "boolean"}},
        "required": ["city", "population", "coastal"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_sampled_outputs_parse_and_satisfy_the_schema(engine, seed):
    sampling = SamplingConfig(max_tokens=100, temperature=1.0, seed=seed, json_schema=json.dumps(CITY))
    out = engine.generate("Describe the largest city of France as JSON.", sampling)
    value = json.loads(out.text)
    assert set(value) == {"city", "population", "coastal"}
    assert isinstance(value["city"], str) and isinstance(value["coastal"], bool)
    assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999999
    assert len(value["city"]) <= 30
    assert out.finish_reason == "stop"  # the grammar ended it, not max_tokens


def test_json_mode_gives_an_object_and_leaves_other_requests_alone(engine):
    prompt = "Name three colors."
    free = engine.generate(prompt, SamplingConfig(max_tokens=12))
    held = engine.generate(prompt, SamplingConfig(max_tokens=60, json_schema='{"type": "object"}'))
    assert isinstance(json.loads(held.text), dict)
    assert engine.generate(prompt, SamplingConfig(max_tokens=12)).token_ids == free.token_ids


@pytest.mark.parametrize("schema, message", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "nonsense"}', "cannot be compiled: .*nonsense"),
    ('{"maximum": 18446744211039428608}', "cannot be compiled: .*not JSON serializable"),  # past 64 bits: was a 500
])
def test_a_schema_it_cannot_compile_is_refused_at_submit(engine, schema, message):
    with pytest.raises(ConfigError, match=message):
        engine.submit("Hello", SamplingConfig(json_schema=schema))


def test_the_mask_allows_exactly_what_the_grammar_does(engine):
    """After '{"a": ' under {a: integer}, only digits and a minus sign may start the value; the
    model's padded vocabulary (ids past the tokenizer's) is forbidden."""
    tok = engine.tokenizer
    grammars = Grammars(tok.to_json(), list(engine.model.args.eos_token_ids))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = grammars.for_request(SamplingConfig(json_schema=json.dumps(schema)))
    for token in tok.encode('{"a": '):
        grammar.accept(token)
    logits = torch.zeros(engine.model.args.vocab_size + 7)  # [V + padding]
    allowed = (grammar.mask(logits) > float("-inf")).nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).lstrip()[:1] in set("-0123456789") for t in allowed)
    assert max(allowed) < engine.model.args.vocab_size
    for token in tok.encode("42}"):
        grammar.accept(token)
    assert grammar.complete
