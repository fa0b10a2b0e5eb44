"""Tool calls read back out of Hermes-format text, whole and streamed in pieces of every size; the
checks of tool_choice; the grammar that forces a call, compiled for the real tokenizers."""

import json

import pytest

from icekv.config.request import SamplingConfig
from icekv.engine.grammar import Grammars
from icekv.serving.tool_calls import ToolCall, ToolCallError, ToolCallStream, tool_choice
from icekv.serving.tool_formats import HERMES, split_calls
from tests.serving.test_tool_formats import streamed

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _hermes_grammar(tools, choice, parallel, token_id=lambda text: None):
    return HERMES.grammar(tools, choice, parallel, token_id)


def _streamed(text: str, size: int, names=()) -> list:
    """The Hermes stream's output for ``text`` fed ``size`` characters at a time, adjacent text merged."""
    return streamed(text, size, HERMES, names)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11, 1000])
def test_calls_and_content_come_out_whatever_the_pieces(size):
    assert _streamed(TWO_CALLS, size) == ["Checking.", PARIS, ToolCall("get_time", "{}")]
    assert split_calls(TWO_CALLS) == ("Checking.", [PARIS, ToolCall("get_time", "{}")])
    plain = "a < b, and <tool is not a tag; </tool_call> alone neither"
    assert _streamed(plain, size) == [plain]
    assert split_calls(plain) == (plain, [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off: never closed
    '<tool_call>\nnot json\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments not an object
])
def test_a_block_that_is_not_a_call_stays_text(text):
    assert split_calls(text) == (text, [])
    assert _streamed(text, 3) == [text]


def test_text_streams_as_soon_as_it_cannot_start_a_call():
    stream = ToolCallStream()
    assert stream.feed("Hello <to") == ["Hello"]  # " <to" may come before or begin a <tool_call>: held
    assert stream.feed("ol_call>\n{") == []
    assert stream.feed('"name": "get_time"}\n</tool_call>') == [ToolCall("get_time", "{}")]
    assert stream.feed("\n  ") == []  # whitespace waits: dropped before a call, or at the end after one
    assert stream.finish() == []


def test_an_untagged_call_counts_only_when_it_is_the_whole_answer_and_names_an_offered_tool():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert split_calls(bare, ["get_weather"]) == (None, [PARIS])
    assert _streamed(" " + bare, 4, ["get_weather"]) == [PARIS]
    assert split_calls(bare, ["get_time"]) == (bare, [])  # not an offered tool
    assert split_calls(bare) == (bare, [])  # no tools offered
    two = bare + "\n" + bare
    assert split_calls(two, ["get_weather"]) == (two, [])
    assert _streamed("Sure: " + bare, 4, ["get_weather"]) == ["Sure: " + bare]


def test_tool_choice_is_checked_against_the_tools():
    assert tool_choice(None, []) == "none"
    assert tool_choice(None, [WEATHER]) == "auto"
    assert tool_choice("get_weather", [WEATHER]) == "get_weather"
    assert tool_choice("none", []) == "none"
    with pytest.raises(ToolCallError, match="needs tools"):
        tool_choice("required", [])
    with pytest.raises(ToolCallError, match="'get_rain', which is not among the tools"):
        tool_choice("get_rain", [WEATHER])


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_the_forcing_grammar_takes_a_whole_call_and_nothing_else(name, smollm2_dir, assets):
    """Compiled for the long-context model, whose <tool_call> is one token (written by its id), and
    for the embedded model, whose tokenizer has no such token (written as text)."""
    from icekv.model import ModelArgs, Tokenizer

    if not assets.is_fetched(name):
        pytest.skip(f"{name} is not fetched")
    folder = assets.model_path(name)
    tok = Tokenizer(folder)
    assert (tok.token_id("<tool_call>") is not None) == (name == "qwen2.5-coder-0.5b")
    grammars = Grammars(tok.to_json(), list(ModelArgs.from_dir(folder).eos_token_ids))
    first_call = TWO_CALLS.split("\n", 1)[1].split("\n<tool_call>")[0]
    for choice, parallel in (("required", True), ("get_weather", False), ("get_weather", True)):
        grammar = grammars.for_request(SamplingConfig(grammar=HERMES.grammar([WEATHER, TIME], choice, parallel,
                                                                             tok.token_id)))
        for token in tok.encode(first_call):
            grammar.accept(token)
        assert grammar.complete == (choice != "required")  # required and parallel: another call may follow
    wrong = grammars.for_request(SamplingConfig(grammar=HERMES.grammar([WEATHER, TIME], "get_time", False,
                                                                       tok.token_id)))
    with pytest.raises(RuntimeError, match="refused"):
        for token in tok.encode(first_call):
            wrong.accept(token)


def test_the_grammar_holds_arguments_to_the_parameters_schema():
    grammar = _hermes_grammar([WEATHER, TIME], "get_weather", False)
    schema = json.loads(grammar.split("%json ", 1)[1])
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["get_weather"]
    assert schema["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert '("\\n" call)*' not in grammar
    both = json.loads(_hermes_grammar([WEATHER, TIME], "required", True).split("%json ", 1)[1])
    assert both["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # no parameters: any object
