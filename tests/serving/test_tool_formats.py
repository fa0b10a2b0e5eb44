"""The model families' tool-call formats: read off a chat template, read back from outputs (whole
and streamed), refused with a reason when malformed, and forced by a grammar in the format's own
delimiters, compiled for a real tokenizer."""

import json

import pytest

from icekv.config.request import SamplingConfig
from icekv.config.serving import TOOL_FORMATS, ServingConfig
from icekv.engine.grammar import Grammars
from icekv.errors import ConfigError
from icekv.serving.tool_calls import ToolCall, ToolCallError, read_call
from icekv.serving.tool_formats import FORMATS, HERMES, LLAMA3, MISTRAL, detect, split_calls, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "when": {"type": "object"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
NESTED = ToolCall("get_weather", '{"city": "Oslo", "when": {"days": [1, 2], "unit": {"tz": "CET"}}}')
NAMES = ("get_weather", "get_time")


def streamed(text: str, size: int, fmt, names=NAMES) -> list:
    """``fmt``'s stream fed ``text`` ``size`` characters at a time, adjacent text merged."""
    stream, parts = fmt.stream(names), []
    for i in range(0, len(text), size):
        parts += stream.feed(text[i: i + size])
    parts += stream.finish()
    merged = []
    for part in parts:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return merged


def test_the_format_is_read_off_the_template_or_set(assets):
    # the families' templates show their format with these words (a few words of each, not the templates)
    assert detect('{{- "<|python_tag|>" + tool_call.name }}') is LLAMA3
    assert detect('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                  'its value}') is LLAMA3
    assert detect("{{- '[TOOL_CALLS]' }}{{ tool_calls | tojson }}") is MISTRAL
    assert detect("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") is HERMES
    assert detect("{{ messages }}") is HERMES and detect(None) is HERMES
    from icekv.chat_template import ChatTemplate

    if assets.is_fetched("qwen2.5-coder-0.5b"):  # a shipped template that shows its format
        source = ChatTemplate.load(assets.model_path("qwen2.5-coder-0.5b")).source
        assert "<tool_call>" in source and detect(source) is HERMES
    assert tool_format("mistral", "<tool_call>") is MISTRAL and tool_format("auto", "[TOOL_CALLS]") is MISTRAL
    assert set(FORMATS) == set(TOOL_FORMATS) - {"auto"}
    with pytest.raises(ConfigError, match="tool_format must be one of auto, hermes, llama3, mistral"):
        ServingConfig(tool_format="gemma")


LLAMA_OUTPUTS = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', [PARIS]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     [PARIS, ToolCall("get_time", "{}")]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo", "when": {"days": [1, 2], "unit": {"tz": "CET"}}}}\n',
     [NESTED]),
    ('{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}', [PARIS]),  # arguments as JSON text
]
MISTRAL_OUTPUTS = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [PARIS]),  # the marker is a special token
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
     [PARIS, ToolCall("get_time", "{}")]),
    ('[{"name": "get_weather", "arguments": {"city": "Oslo", "when": {"days": [1, 2], "unit": {"tz": "CET"}}}}]',
     [NESTED]),
]
HERMES_OUTPUTS = [
    ('<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>', [PARIS]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "when": {"days": [1, 2], '
     '"unit": {"tz": "CET"}}}}\n</tool_call>', [NESTED]),
]


@pytest.mark.parametrize("fmt, text, calls", [(LLAMA3, t, c) for t, c in LLAMA_OUTPUTS]
                         + [(MISTRAL, t, c) for t, c in MISTRAL_OUTPUTS] + [(HERMES, t, c) for t, c in HERMES_OUTPUTS])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_good_outputs_are_read_whole_andstreamed(fmt, text, calls, size):
    assert fmt.read(text) == calls
    assert split_calls(text, NAMES, fmt) == (None, calls)
    assert streamed(text, size, fmt) == calls


@pytest.mark.parametrize("fmt, text, reason", [
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Par', "not JSON objects"),
    (LLAMA3, '{"name": "get_weather", "parameters": [1]}', "arguments must be a JSON object, got list"),
    (LLAMA3, '{"parameters": {}}', "a function's name"),
    (LLAMA3, '{"name": "f", "parameters": {}, "arguments": {}}', "both arguments and parameters"),
    (LLAMA3, '{"name": "f", "parameters": "{not json"}', "arguments text is not JSON"),
    (LLAMA3, '{"name": "f"} trailing words', "not JSON objects"),
    (MISTRAL, '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}', r"begins with '\['"),
    (MISTRAL, '[TOOL_CALLS][]', "non-empty JSON list"),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, 3]', "a function's name"),
    (MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}', "not a JSON list"),
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "no <tool_call> block holds a call"),
])
def test_malformed_outputs_are_refused_with_a_reason_and_stay_content(fmt, text, reason):
    with pytest.raises(ToolCallError, match=reason):
        fmt.read(text)
    assert split_calls(text, NAMES, fmt) == (text, [])  # the client gets the text whole, nothing dropped
    assert streamed(text, 3, fmt) == [text]


@pytest.mark.parametrize("fmt", [LLAMA3, MISTRAL])
def test_plain_answers_pass_at_once(fmt):
    stream = fmt.stream(NAMES)
    assert stream.feed("  ") == [] and stream.feed("The weather") == ["  The weather"]
    assert stream.feed(" is [fine] {today}") == [" is [fine] {today}"] and stream.finish() == []
    assert split_calls("[a link](x) and {braces}", NAMES, fmt) == ("[a link](x) and {braces}", [])


def test_a_call_object_is_read_by_one_rule():
    assert read_call({"name": "f", "parameters": {"x": [1, {"y": None}]}}) == ToolCall("f", '{"x": [1, {"y": null}]}')
    assert read_call({"name": "f"}) == read_call({"name": "f", "id": "c1", "type": "function"}) == ToolCall("f", "{}")
    for bad in ([], {"name": ""}, {"name": 3}, {"name": "f", "arguments": 3}):
        with pytest.raises(ToolCallError):
            read_call(bad)
    with pytest.raises(ToolCallError, match="holds args, which is not its arguments"):  # never read as f({})
        read_call({"name": "f", "args": {"city": "Paris"}})


@pytest.mark.parametrize("fmt, text", [
    (LLAMA3, '{"name": "Ada Lovelace", "born": 1815}'),  # an answer that is JSON of its own
    (LLAMA3, '{"name": "get_weather", "parameters": {}}; {"name": "rm_rf", "parameters": {}}'),
    (MISTRAL, '[{"name": "Ada", "arguments": {}}]'),
])
def test_a_call_to_a_function_not_offered_is_content(fmt, text):
    assert split_calls(text, NAMES, fmt) == (text, [])
    assert streamed(text, 5, fmt) == [text]


CALL_TEXT = {  # a forced call as each format's grammar writes it (compact JSON: one space after separators)
    HERMES: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    LLAMA3: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MISTRAL: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}


@pytest.mark.model
@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
@pytest.mark.parametrize("parallel", [False, True])
def test_each_format_forces_its_own_calls_with_a_tokenizer_that_lacks_its_tokens(fmt, parallel, smollm2_dir):
    """The embedded model's tokenizer has none of the formats' delimiter tokens: each grammar
    writes them as text, compiles, takes a whole call in the format, and refuses another function."""
    from icekv.model import Tokenizer

    tok = Tokenizer(smollm2_dir)
    assert all(tok.token_id(t) is None for t in ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]"))
    grammars = Grammars(tok.to_json(), [2])
    grammar = grammars.for_request(SamplingConfig(grammar=fmt.grammar([WEATHER, TIME], "required", parallel,
                                                                      tok.token_id)))
    for token in tok.encode(CALL_TEXT[fmt]):
        grammar.accept(token)
    assert grammar.complete == (not parallel or fmt is MISTRAL)  # a list is closed by its "]"
    assert fmt.read(CALL_TEXT[fmt]) == [PARIS]
    wrong = grammars.for_request(SamplingConfig(grammar=fmt.grammar([WEATHER, TIME], "get_time", parallel,
                                                                    tok.token_id)))
    with pytest.raises(RuntimeError, match="refused"):
        for token in tok.encode(CALL_TEXT[fmt]):
            wrong.accept(token)


@pytest.mark.model
def test_an_optional_marker_token_compiles_and_may_be_left_out(assets):
    """Mistral's ``[TOOL_CALLS]`` written as a token id, optional: compiled with Qwen's tokenizer,
    its ``<tool_call>`` token standing in for the marker."""
    from icekv.model import Tokenizer

    if not assets.is_fetched("qwen2.5-coder-0.5b"):
        pytest.skip("qwen2.5-coder-0.5b is not fetched")
    tok = Tokenizer(assets.model_path("qwen2.5-coder-0.5b"))
    marker = tok.token_id("<tool_call>")
    grammars = Grammars(tok.to_json(), [tok.token_id("<|im_end|>")])
    text = CALL_TEXT[MISTRAL].removeprefix("[TOOL_CALLS]")
    for ids in ([marker] + tok.encode(text), tok.encode(text)):
        grammar = grammars.for_request(SamplingConfig(grammar=MISTRAL.grammar(
            [WEATHER], "required", False, lambda t: marker if t == "[TOOL_CALLS]" else None)))
        for token in ids:
            grammar.accept(token)
        assert grammar.complete


def test_a_delimiter_the_vocabulary_holds_is_written_as_its_token():
    ids = {"[TOOL_CALLS]": 5, "<tool_call>": 7, "</tool_call>": 8}
    assert MISTRAL.grammar([WEATHER], "required", False, ids.get).startswith("start: <[5]>? ")
    assert "call: <[7]> " in HERMES.grammar([WEATHER], "required", False, ids.get)
    assert "<[8]>" in HERMES.grammar([WEATHER], "required", False, ids.get)
    schema = json.loads(LLAMA3.grammar([WEATHER, TIME], "get_time", False, ids.get).split("%json ", 1)[1])
    assert [c["required"] for c in schema["anyOf"]] == [["name", "parameters"]]
