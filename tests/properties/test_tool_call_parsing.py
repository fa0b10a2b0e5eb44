"""Properties of reading tool calls out of a model's text (:mod:`icekv.serving.tool_calls`), the
Hermes format and the untagged call object small models answer with: a call written in the format
reads back as the same name and arguments, streamed in any pieces as read whole; text in which
nothing is a call comes back unchanged; any text is read without an exception (the text is the
model's, anything may be in it). And tool_choice refuses only with its own ToolCallError."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from icekv.serving.tool_calls import CLOSE, OPEN, ToolCall, ToolCallError, ToolCallStream, tool_choice
from icekv.serving.tool_formats import split_calls

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=300)

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3),
                           max_leaves=8)
ARGUMENTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
NAMES = st.text(min_size=1, max_size=12)
# pieces of the format, so that drawn texts are full of near-calls, stray tags and cut-off objects
FRAGMENTS = st.sampled_from([OPEN, CLOSE, OPEN[:5], CLOSE[-6:], "<", "{", "}", "[1]", '"name"', '"arguments"',
                             ": ", ", ", '"f"', "{}", " ", "\n", "\t", "a", "é", "😀", '{"name": "f"}',
                             '{"name": "f", "arguments": {"x": 1}}'])
TEXTS = st.lists(st.one_of(FRAGMENTS, FRAGMENTS, FRAGMENTS, st.characters()), max_size=16).map("".join)
PLAIN = st.text(max_size=40).filter(lambda t: OPEN not in t and CLOSE not in t)


def _render(name: str, arguments: dict, ascii_only: bool) -> str:
    """One call as the format writes it (the chat template's example, the forcing grammar's output)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=ascii_only)}\n{CLOSE}"


def _streamed(text: str, cuts: list[int], names=()) -> list:
    """``text`` fed in pieces cut at ``cuts``; the parts with adjacent text merged."""
    stream, parts, at = ToolCallStream(names), [], 0
    for cut in sorted(set(c % (len(text) + 1) for c in cuts)) + [len(text)]:
        parts += stream.feed(text[at:cut])
        at = cut
    merged = []
    for part in parts + stream.finish():
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return merged


def _whole(text: str, names=()) -> list:
    return _streamed(text, [], names)


@SETTINGS
@given(content=PLAIN, calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3), ascii_only=st.booleans(),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_a_rendered_call_reads_back_as_the_same_name_and_arguments(content, calls, ascii_only, cuts):
    """Text then calls, as a model writes them: the text and every call come back, whole or streamed."""
    blocks = [_render(name, arguments, ascii_only) for name, arguments in calls]
    if any(CLOSE in block[len(OPEN): -len(CLOSE)] for block in blocks):
        return  # a closing tag inside the object ends the block early: the format cannot carry it
    text = content + "".join("\n" + block for block in blocks)
    found_content, found = split_calls(text)
    assert [c.name for c in found] == [name for name, _ in calls]
    assert [json.loads(c.arguments) for c in found] == [arguments for _, arguments in calls]
    assert found_content == (content.strip() or None)
    streamed = _streamed(text, cuts)
    assert [p for p in streamed if isinstance(p, ToolCall)] == found
    assert "".join(p for p in streamed if isinstance(p, str)).strip() == content.strip()


@SETTINGS
@given(text=TEXTS, names=st.lists(st.sampled_from(["f", "g", ""]), max_size=2),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_any_text_streamed_in_any_pieces_reads_as_it_does_whole(text, names, cuts):
    """No text raises (the format has no error to raise: what is not a call is content), and where
    the stream is cut changes nothing of what comes out."""
    whole = _whole(text, names)
    assert _streamed(text, cuts, names) == whole
    content, calls = split_calls(text, names)
    assert calls == [p for p in whole if isinstance(p, ToolCall)]
    assert all(isinstance(json.loads(c.arguments), dict) and isinstance(c.name, str) for c in calls)
    if calls and not text.lstrip().startswith("{"):
        assert text.count(OPEN) >= len(calls) and text.count(CLOSE) >= len(calls)  # each call is a closed block


@SETTINGS
@given(text=TEXTS, names=st.lists(st.sampled_from(["f", "g"]), max_size=2),
       cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_text_in_which_nothing_is_a_call_comes_back_unchanged(text, names, cuts):
    """A block that is not a call, a stray or cut-off tag, and the whitespace around them are the
    model's content: the client must see them as written."""
    content, calls = split_calls(text, names)
    if not calls:
        assert content == text
        assert "".join(p for p in _streamed(text, cuts, names) if isinstance(p, str)) == text


@SETTINGS
@given(text=PLAIN, names=st.lists(NAMES, max_size=2))
def test_text_without_a_tag_or_an_object_has_no_calls(text, names):
    if names and text.lstrip().startswith("{"):
        text = "x" + text  # an untagged object may be a call when tools are offered
    assert split_calls(text, names) == (text, [])


@SETTINGS
@given(name=NAMES, arguments=ARGUMENTS, offered=st.booleans(), pad=st.sampled_from(["", " ", "\n", " \n "]),
       cuts=st.lists(st.integers(0, 10_000), max_size=6))
def test_an_untagged_call_counts_only_when_it_names_an_offered_tool(name, arguments, offered, pad, cuts):
    bare = pad + json.dumps({"name": name, "arguments": arguments}) + pad
    names = [name] if offered else [name + "_other"]
    expected = (None, [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]) if offered else (bare, [])
    assert split_calls(bare, names) == expected
    assert [p for p in _streamed(bare, cuts, names) if isinstance(p, ToolCall)] == expected[1]


TOOLS = st.lists(st.builds(lambda name: {"type": "function", "function": {"name": name}}, NAMES), max_size=3)


@SETTINGS
@given(choice=st.none() | st.sampled_from(["none", "auto", "required"]) | NAMES, tools=TOOLS)
def test_tool_choice_is_a_keyword_or_an_offered_name_else_a_tool_call_error(choice, tools):
    names = [t["function"]["name"] for t in tools]
    try:
        checked = tool_choice(choice, tools)
    except ToolCallError:
        assert choice is not None and choice != "none" and (not tools or choice not in ("auto", "required", *names))
        return
    assert checked == (choice if choice is not None else "auto" if tools else "none")
    assert checked in ("none", "auto", "required", *names)


@settings(deadline=None, derandomize=True, database=None, max_examples=25)
@given(depth=st.integers(1, 400) | st.integers(2000, 5000), digits=st.integers(1, 4000) | st.integers(4400, 6000),
       tagged=st.booleans())
def test_a_call_whose_json_python_cannot_read_is_content(depth, digits, tagged):
    """Nesting past the interpreter's recursion limit and integers past its int-string limit make
    json raise RecursionError and ValueError, not JSONDecodeError: such a body is text, as any other
    the parser cannot read; below those limits it is a call. (The limits themselves are avoided: how
    deep json may go depends on the stack it starts from.)"""
    for value, readable in (("[" * depth + "]" * depth, depth <= 400), ("9" * digits, digits <= 4000)):
        body = '{"name": "f", "arguments": {"x": ' + value + "}}"
        text = f"{OPEN}\n{body}\n{CLOSE}" if tagged else body
        expected = [ToolCall("f", json.dumps({"x": json.loads(value)}))] if readable else []
        assert split_calls(text, ["f"]) == ((None, expected) if readable else (text, []))


def test_a_call_with_a_5000_digit_number_or_5000_nested_lists_is_content():
    """Regression: both raised out of the parser (ValueError, RecursionError) instead of staying text."""
    for value in ("9" * 5000, "[" * 5000 + "]" * 5000):
        body = '{"name": "f", "arguments": {"x": ' + value + "}}"
        assert split_calls(f"{OPEN}{body}{CLOSE}") == (f"{OPEN}{body}{CLOSE}", [])
        assert split_calls(body, ["f"]) == (body, [])


def test_whitespace_before_a_block_that_is_not_a_call_is_kept():
    """Regression: '\\r<tool_call>' and 'a <tool_call>x</tool_call>' lost the whitespace before the tag."""
    for text in ("\r<tool_call>", "a <tool_call>x</tool_call>", "a\n<tool_call>not json\n</tool_call> b"):
        assert split_calls(text) == (text, [])
        assert _whole(text) == [text]
