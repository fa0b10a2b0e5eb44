"""Properties of rendering chat messages with the real models' chat templates (:mod:`icekv.chat_template`):
whatever the OpenAI frontend's message model accepts (:class:`icekv.serving.openai.messages.ChatMessage`)
renders, with every message's text in the prompt in the order sent (a message the model never sees
is a silent loss); and any list of anything either renders or is refused with ChatTemplateError,
the one error the server turns into a 400 (a jinja, Key or Type error would be a 500)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icekv.chat_template import ROLES, ChatTemplate, ChatTemplateError, message_text
from icekv.serving.openai.messages import ChatMessage

pytestmark = pytest.mark.model

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=120)
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")

# text a template may trip on: its own markers, jinja syntax, quotes, unicode, nothing at all
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "\n", "<|im_start|>", "<|im_end|>", "{{ x }}",
                                                         "{% if %}", "'\"", "\\", "ünïcødé 😀", "<tool_call>"]))
ARGUMENTS = st.dictionaries(st.text(max_size=6), st.none() | st.integers() | st.text(max_size=6) | st.booleans(),
                            max_size=3)
TOOL_CALL = st.builds(lambda i, name, args: {"id": i, "type": "function",
                                             "function": {"name": name, "arguments": json.dumps(args)}},
                      st.text(max_size=6), st.text(min_size=1, max_size=10), ARGUMENTS)
PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), min_size=1, max_size=3)
TOOL = st.builds(lambda name, desc: {"type": "function", "function": {"name": name, "description": desc,
                                                                      "parameters": {"type": "object"}}},
                 st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), TEXT)


@st.composite
def _message(draw) -> dict:
    """A message the OpenAI frontend accepts."""
    role = draw(st.sampled_from(ROLES))
    calls = draw(st.lists(TOOL_CALL, min_size=1, max_size=2)) if role == "assistant" and draw(st.booleans()) else None
    content = draw(st.one_of(TEXT, PARTS, *([st.none()] if calls else [])))
    message = {"role": role, "content": content}
    if calls:
        message["tool_calls"] = calls
    if role == "tool":
        message["tool_call_id"] = draw(st.text(max_size=6))
    if draw(st.booleans()):
        message["name"] = draw(st.text(max_size=6))
    return message


ANYTHING = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=6)


@st.composite
def _mangled(draw) -> object:
    """A message from a client that got it wrong: a field of the wrong type, an unknown role, a
    malformed tool call, or no object at all."""
    message = dict(draw(_message()))
    key = draw(st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name", None]))
    if key is None:
        return draw(ANYTHING)
    message[key] = draw(st.one_of(ANYTHING, st.just([{"function": {"name": "f", "arguments": "[1]"}}]),
                                  st.just([{"function": {"name": "f", "arguments": "{"}}]), st.just("wizard")))
    return message


@pytest.fixture(scope="module", params=MODELS)
def template(request, assets) -> ChatTemplate:
    if not assets.is_fetched(request.param):
        pytest.skip(f"{request.param} is not fetched")
    return ChatTemplate.load(assets.model_path(request.param))


def _in_order(rendered: str, texts: list[str]) -> bool:
    at = 0
    for text in texts:
        at = rendered.find(text, at)
        if at < 0:
            return False
        at += len(text)
    return True


@SETTINGS
@given(messages=st.lists(_message(), min_size=1, max_size=5), tools=st.lists(TOOL, max_size=2, unique_by=lambda t:
                                                                             t["function"]["name"]),
       add_generation_prompt=st.booleans())
def test_what_the_frontend_accepts_renders_with_every_message_in_order(template, messages, tools,
                                                                       add_generation_prompt):
    sent = [ChatMessage.model_validate(m).for_template() for m in messages]  # the frontend's own check
    if tools and not template.renders_tools:
        with pytest.raises(ChatTemplateError, match="does not render tools"):
            template.render(sent, tools)
        return
    rendered = template.render(sent, tools, add_generation_prompt=add_generation_prompt)
    texts = [message_text(m["content"], "") if m["content"] is not None else "" for m in sent]
    assert _in_order(rendered, texts), (texts, rendered)
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt
    if "tool_calls" in template.source:  # a template that shows earlier calls shows every one
        called = [c["function"]["name"] for m in sent for c in m.get("tool_calls", [])]
        assert _in_order(rendered, called)


@SETTINGS
@given(messages=st.one_of(st.lists(st.one_of(_message(), _mangled()), max_size=4), ANYTHING),
       tools=st.none() | st.lists(st.one_of(TOOL, ANYTHING), max_size=2) | ANYTHING)
def test_anything_renders_or_is_refused_with_a_chat_template_error(template, messages, tools):
    try:
        rendered = template.render(messages, tools)
    except ChatTemplateError as e:
        assert str(e)
        return
    assert isinstance(rendered, str) and isinstance(messages, list) and messages


def test_a_developer_message_is_rendered(template):
    """Regression: Qwen's template knows no developer role and dropped the message without a word."""
    rendered = template.render([{"role": "developer", "content": "Answer in French."},
                                {"role": "user", "content": "Hi"}])
    assert _in_order(rendered, ["Answer in French.", "Hi"])


def _called(arguments) -> list[dict]:
    return [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]


def test_tool_call_arguments_nested_5000_deep_or_of_5000_digits_are_refused_with_a_chat_template_error(template):
    """Regression: json's RecursionError and ValueError (an integer past Python's int-string limit)
    left render, as did RecursionError where the template prints arguments nested too deep (sent
    as an object, which render takes as well as JSON text)."""
    for arguments in ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", '{"a": ' + "9" * 5000 + "}"):
        with pytest.raises(ChatTemplateError, match="arguments is not valid JSON"):
            template.render(_called(arguments))
    deep = {}
    for _ in range(5000):
        deep = {"a": deep}
    if "tool_calls" in template.source:  # a template that prints the arguments
        with pytest.raises(ChatTemplateError, match="chat template failed"):
            template.render(_called(deep))
    else:
        assert "x" in template.render(_called(deep))
