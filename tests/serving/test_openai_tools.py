"""OpenAI tools against real tritonservers: the long-context model (Qwen2.5, whose chat template
renders tools) calls a function through the official client, streamed and not, forced and not, and
answers from the tool's result in the next turn; LangChain's ChatOpenAI does the same round trip.
The embedded model's template cannot show tools, and says so; malformed tools and choices get
OpenAI-shaped 400s, and the server keeps serving."""

import json
import urllib.request

import openai
import pytest

from icekv.serving.launcher import TritonServer, free_port
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.process import OpenAIFrontendProcess
from icekv.serving.tool_calls import ToolCall
from icekv.serving.tool_formats import split_calls

pytestmark = [pytest.mark.server, pytest.mark.model]
LONGCTX = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "It is 18 degrees Celsius and sunny in Paris."


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _served(assets, work, parameters: dict):
    """The OpenAI frontend's URL of a tritonserver serving the long-context model with ``parameters``."""
    if not assets.is_fetched(LONGCTX):
        pytest.skip(f"{LONGCTX} is not fetched (icekv fetch --model {LONGCTX})")
    server = TritonServer({"model_dir": LONGCTX, **parameters}, log_path=work / "tritonserver.log")
    server.start()
    try:
        config = OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port())
        with OpenAIFrontendProcess(config, log_path=work / "frontend.log") as frontend:
            yield frontend.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def qwen_url(assets, tmp_path_factory):
    yield from _served(assets, tmp_path_factory.mktemp("qwen_tools"), {"pool_tokens": "8192",
                                                                      "max_active_requests": "4"})


@pytest.fixture(scope="module")
def qwen(qwen_url):
    return _client(qwen_url)


def _one_call(message, name="get_weather") -> dict:
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == name and call.id.startswith("call_")
    return json.loads(call.function.arguments)


@pytest.mark.longctx_model
def test_the_model_calls_a_tool_and_answers_from_its_result(qwen):
    reply = qwen.chat.completions.create(model="icekv", messages=ASK, tools=[WEATHER, TIME], max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _one_call(choice.message) == {"city": "Paris"}
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": RESULT}]
    # the small model keeps calling while tools are offered (tool_choice auto): "none" makes it answer
    answer = qwen.chat.completions.create(model="icekv", messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                          max_tokens=60)
    assert answer.choices[0].message.tool_calls is None
    assert "18" in answer.choices[0].message.content
    alone = qwen.chat.completions.create(model="icekv", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result were rendered


@pytest.mark.longctx_model
def test_streamed_calls_arrive_whole_in_tool_call_deltas(qwen):
    chunks = list(qwen.chat.completions.create(model="icekv", messages=ASK, tools=[WEATHER], max_tokens=60,
                                               stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    entries = [t for d in deltas for t in d.tool_calls or ()]
    assert [(t.index, t.function.name) for t in entries] == [(0, "get_weather")]
    assert json.loads(entries[0].function.arguments) == {"city": "Paris"}
    assert not "".join(d.content or "" for d in deltas)  # the call is not also sent as text
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.longctx_model
@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_call_goes_to_the_named_function(qwen, parallel):
    """tool_choice names get_time for a weather question: the grammar makes the model call it, once
    (offered more, the small model repeats the call until its token limit)."""
    reply = qwen.chat.completions.create(
        model="icekv", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, parallel_tool_calls=parallel,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = reply.choices[0].message
    names = {c.function.name for c in message.tool_calls}
    assert names == {"get_time"} and all(isinstance(json.loads(c.function.arguments), dict) for c in message.tool_calls)
    assert len(message.tool_calls) == 1 and reply.choices[0].finish_reason == "tool_calls"
    required = qwen.chat.completions.create(model="icekv", messages=[{"role": "user", "content": "Hello!"}],
                                            tools=[WEATHER], tool_choice="required", max_tokens=60,
                                            parallel_tool_calls=False)
    assert _one_call(required.choices[0].message).keys() <= {"city"}


@pytest.mark.longctx_model
def test_langchain_binds_tools_and_runs_a_round_trip(qwen_url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return RESULT if city == "Paris" else "unknown"

    llm = ChatOpenAI(model="icekv", base_url=f"{qwen_url}/v1", api_key="unused", temperature=0, max_tokens=60,
                     max_retries=0)
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather]).invoke(messages)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert not final.tool_calls and "18" in final.content


@pytest.mark.longctx_model
def test_the_generate_extension_takes_tools_and_returns_the_raw_text(qwen_url):
    body = {"messages": json.dumps(ASK), "tools": json.dumps([WEATHER]), "tool_choice": "get_weather",
            "parallel_tool_calls": False, "max_tokens": 60}
    request = urllib.request.Request(f"{qwen_url}/v2/models/icekv/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=300) as r:
        out = json.loads(r.read())
    assert split_calls(out["text_output"]) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])
    assert out["text_output"].startswith("<tool_call>\n")


def test_the_embedded_model_cannot_be_offered_tools(openai_frontend):
    """SmolLM2's chat template does not render tools: a clear 400, not a prompt without them."""
    client = _client(openai_frontend.url)
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(model="icekv", messages=ASK, tools=[WEATHER], max_tokens=8)
    none = client.chat.completions.create(model="icekv", messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4)
    assert none.choices[0].message.tool_calls is None  # tools not shown, so nothing to refuse


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_rain"}}},
     "tool_choice", "'get_rain' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", '"none", "auto", "required" or'),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0]", "needs tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "content is required"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "cannot also be held to response_format"),
])
def test_malformed_tools_get_openai_shaped_400s(openai_frontend, body, param, message):
    client = _client(openai_frontend.url)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="icekv", **{"messages": ASK, "max_tokens": 4, **body})
    error = refused.value.body
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="icekv", messages=ASK, max_tokens=2).choices[0].message.content


@pytest.fixture(scope="module")
def llama3_url(assets, tmp_path_factory):
    """The long-context model served with the Llama 3 tool-call format set (its template teaches
    Hermes'; the setting overrides it, as for a model whose template names no format)."""
    yield from _served(assets, tmp_path_factory.mktemp("llama3_calls"), {"pool_tokens": "4096",
                                                                        "tool_format": "llama3"})


@pytest.mark.longctx_model
def test_a_set_format_forces_and_reads_calls_in_that_format(llama3_url):
    """The forced call is written as Llama 3's bare object with ``parameters``, and read back with
    its arguments, whole and streamed."""
    body = {"messages": json.dumps(ASK), "tools": json.dumps([WEATHER]), "tool_choice": "get_weather",
            "parallel_tool_calls": False, "max_tokens": 60}
    request = urllib.request.Request(f"{llama3_url}/v2/models/icekv/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=300) as r:
        assert json.loads(r.read())["text_output"].startswith('{"name": "get_weather", "parameters": {')
    llama3_calls = _client(llama3_url)
    ask = dict(model="icekv", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60,
               parallel_tool_calls=False)
    reply = llama3_calls.chat.completions.create(**ask)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    assert _one_call(reply.choices[0].message).keys() == {"city"}
    chunks = list(llama3_calls.chat.completions.create(**ask, stream=True))
    calls = [c for chunk in chunks for d in chunk.choices for c in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == _one_call(reply.choices[0].message)
    assert not any(d.delta.content for chunk in chunks for d in chunk.choices)  # the call is not shown as text
