"""Request validation without a server: tensors and parameters, types and ranges."""

from dataclasses import replace

import numpy as np
import pytest

from icekv.config.settings import serving_config
from icekv.config.serving import ServingConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.methods.snapkv import SnapKVConfig
from icekv.serving.request import RequestError, parse_request

CFG = ServingConfig()


def test_tensors_and_parameters_are_read_and_tensors_win():
    req = parse_request(
        {"text_input": np.array([b"hello"], dtype=object), "max_tokens": np.array([7], dtype=np.int32)},
        {"max_tokens": 99, "policy": "quest", "budget": 128, "stop": ["."], "stream": True},
        CFG,
    )
    assert req.text == "hello" and req.sampling.max_tokens == 7 and req.stream
    assert req.plan.name == "quest" and req.plan.budget == 128 and req.sampling.stop == (".",)


def test_defaults_come_from_the_serving_config():
    req = parse_request({"text_input": np.array([b"x"], dtype=object)}, {}, CFG)
    assert req.sampling.max_tokens == CFG.default_max_tokens and req.plan is None  # the engine's own plan
    assert req.caching.enabled and req.caching.retention_s == 0
    off = parse_request({"text_input": np.array([b"x"], dtype=object), "cache_prompt": np.array([False])}, {}, CFG)
    assert not off.caching.enabled
    tuned = parse_request({"text_input": np.array([b"x"], dtype=object)},
                          {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": '{"7": -100, "9": 2.5}'}, CFG)
    assert tuned.sampling.frequency_penalty == 0.5 and tuned.sampling.repetition_penalty == 1.2
    assert tuned.sampling.logit_bias == ((7, -100.0), (9, 2.5))
    kept = parse_request({"text_input": np.array([b"x"], dtype=object)}, {"cache_retention_s": 30}, CFG)
    assert kept.caching.retention_s == 30


def test_a_request_override_keeps_every_other_selection_setting():
    """policy and budget from the request; each method's own settings and an explicit sink or
    window stay the server's (the derived ones follow the new budget)."""
    selection = replace(CFG.engine.selection, n_sink_pages=3, snapkv=SnapKVConfig(window=8),
                        icecache=IceCacheConfig(search="walk", min_candidates=64))
    cfg = replace(CFG, engine=replace(CFG.engine, selection=selection))
    req = parse_request({"text_input": np.array([b"x"], dtype=object)}, {"policy": "snapkv", "budget": 512}, cfg)
    assert req.plan.selection == replace(selection, policy="snapkv", budget=512)
    assert req.plan.selection.snapkv.window == 8 and req.plan.window_queries == 8
    assert req.plan.sink_pages == 3 and req.plan.window_pages == 2  # explicit, and derived from 512
    small = parse_request({"text_input": np.array([b"x"], dtype=object)}, {"budget": 128}, cfg)
    assert small.plan.name == "icecache" and small.plan.selection.icecache.search == "walk"
    assert (small.plan.sink_pages, small.plan.window_pages, small.plan.selected_pages) == (3, 2, 3)


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": "ten"}, "max_tokens must be an integer"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"stream": "yes"}, "stream must be true or false"),
    ({"cache_prompt": 1}, "cache_prompt must be true or false"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": "high"}, "repetition_penalty must be a number"),
    ({"logit_bias": "{"}, "logit_bias is not valid JSON"),
    ({"logit_bias": "[1, 2]"}, "logit_bias must be a JSON object"),
    ({"logit_bias": '{"apple": 1}'}, "logit_bias keys must be token ids, got 'apple'"),
    ({"logit_bias": '{"5": "up"}'}, r"logit_bias\[5\] must be a number"),
    ({"logit_bias": '{"5": 200}'}, r"logit_bias maps token ids >= 0 to biases in \[-100, 100\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"logprobs": 1.5}, "logprobs must be an integer"),
    ({"cache_retention_s": "long"}, "cache_retention_s must be a number"),
    ({"cache_retention_s": -1}, r"cache_retention_s must be in \[0, 600\]"),
    ({"cache_retention_s": 1e6}, r"\(max_cache_retention_s\), got 1e\+06"),
    ({"cache_retention_s": 5, "cache_prompt": False}, "cache_retention_s needs cache_prompt"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"policy": 3}, "policy must be a string"),
    ({"stop": [1]}, "stop must be a string"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop strings per request, got 5"),
    ({"stop": ["x" * 2000]}, "at most 128 characters, got 2000"),
])
def test_wrong_types_in_parameters(params, message):
    with pytest.raises(RequestError, match=message):
        parse_request({"text_input": np.array([b"x"], dtype=object)}, params, CFG)


def test_unknown_parameters_are_refused_by_name():
    with pytest.raises(RequestError, match=r"unknown parameters \['budgt', 'device'\]; the model takes"):
        parse_request({"text_input": np.array([b"x"], dtype=object)}, {"budgt": 5, "device": "cuda"}, CFG)
    req = parse_request({"text_input": np.array([b"x"], dtype=object)}, {"triton_enable_empty_final_response": True}, CFG)
    assert req.text == "x"  # Triton's own parameters pass


def test_invalid_utf8_is_refused():
    with pytest.raises(RequestError, match="UTF-8"):
        parse_request({"text_input": np.array([b"\xff\xfe"], dtype=object)}, {}, CFG)


def test_serving_config_from_triton_parameters():
    cfg = serving_config({
        "policy": {"string_value": "quest"}, "budget": {"string_value": "128"},
        "pool_tokens": {"string_value": "4096"}, "max_active_requests": {"string_value": "2"},
        "max_index_bytes": {"string_value": "1048576"}, "max_step_tokens": {"string_value": "256"},
    })
    assert cfg.engine.selection.policy == "quest" and cfg.engine.paging.pool_tokens == 4096
    scheduler = cfg.engine.scheduler
    assert scheduler.max_active_requests == 2 and scheduler.max_index_bytes == 1 << 20 and scheduler.max_step_tokens == 256
    assert serving_config({}).engine.scheduler.max_index_bytes is None  # default: the pool's size
    with pytest.raises(Exception, match="max_step_tokens .4. must exceed max_active_requests .8."):
        serving_config({"max_step_tokens": "4"})
    for narrow in ("bfloat16", "int8"):  # half, about a quarter of the index memory
        assert serving_config({"score_dtype": narrow}).engine.selection.icecache.score_dtype == narrow
    with pytest.raises(Exception, match="score_dtype must be one of auto, float32, bfloat16, int8"):
        serving_config({"score_dtype": "float16"})
    with pytest.raises(Exception, match="max_index_bytes must be >= 0"):
        serving_config({"max_index_bytes": "-1"})
    assert serving_config({"max_device_bytes": "4096"}).engine.scheduler.max_device_bytes == 4096
    with pytest.raises(Exception, match="max_device_bytes must be >= 0"):
        serving_config({"max_device_bytes": "-1"})
    assert serving_config({"index_threads": "2"}).engine.index_threads == 2
    assert serving_config({}).engine.index_threads is None  # the cores prefill leaves free
    with pytest.raises(Exception, match="index_threads must be >= 0"):
        serving_config({"index_threads": "-2"})
    with pytest.raises(Exception, match="unknown model parameters"):
        serving_config({"polcy": {"string_value": "quest"}})
    with pytest.raises(Exception, match="budget must be an integer"):
        serving_config({"budget": {"string_value": "lots"}})
    assert cfg.engine.selection.icecache.search == "centroids"  # the default, as the library's
    walk = serving_config({"search": "walk"})
    assert walk.engine.selection.icecache.search == "walk"
    with pytest.raises(Exception, match="search must be one of walk, exhaustive, centroids"):
        serving_config({"search": "beam"})
    assert serving_config({}).engine.selection.icecache.centroid_scoring == "auto"
    host = serving_config({"centroid_scoring": "host"}).engine.selection.icecache
    assert host.centroid_scoring == "host" and not host.scores_centroids_on_device("cuda")
    with pytest.raises(Exception, match="centroid_scoring must be one of auto, host, device, got 'gpu'"):
        serving_config({"centroid_scoring": "gpu"})
    with pytest.raises(Exception, match="centroid_scoring 'device' applies to search 'centroids'"):
        serving_config({"centroid_scoring": "device", "search": "walk"})
    icecache = lambda params: serving_config(params).engine.selection.icecache  # noqa: E731
    rescored = icecache({"search": "centroids", "rescoring": "device"})
    assert rescored.rescores_on_device() and rescored.scores_centroids_on_device("cpu")  # ranked there too
    assert not icecache({"search": "centroids"}).rescores_on_device()
    with pytest.raises(Exception, match="rescoring must be one of host, device, got 'gpu'"):
        serving_config({"rescoring": "gpu"})
    with pytest.raises(Exception, match="rescoring 'device' applies to search 'centroids'"):
        serving_config({"rescoring": "device", "search": "walk"})
    with pytest.raises(Exception, match="centroid_scoring 'host' contradicts it"):
        serving_config({"search": "centroids", "rescoring": "device", "centroid_scoring": "host"})


def _template():
    from icekv.chat_template import ChatTemplate

    return ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}", {})


def test_messages_are_rendered_with_the_chat_template():
    messages = '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]'
    req = parse_request({"messages": np.array([messages.encode()], dtype=object)}, {}, CFG, _template().render)
    assert req.text == "user:hi|assistant:yo|"


@pytest.mark.parametrize("inputs, message", [
    ({}, "exactly one of text_input"),
    ({"text_input": "x", "messages": "[]"}, "exactly one of text_input"),
    ({"messages": "[{"}, "messages is not valid JSON"),
    ({"messages": "[]"}, "messages must be a non-empty list"),
    ({"messages": '[{"role": "wizard", "content": "x"}]'}, r"messages\[0\].role must be one of"),
    ({"messages": '[{"role": "user", "content": 3}]'}, r"messages\[0\].content must be a string"),
    ({"messages": '[{"role": "user", "content": [{"type": "image_url"}]}]'}, "must be a text part"),
])
def test_bad_messages_are_refused(inputs, message):
    inputs = {k: np.array([v.encode()], dtype=object) for k, v in inputs.items()}
    with pytest.raises(RequestError, match=message):
        parse_request(inputs, {}, CFG, _template().render)


def test_messages_without_a_template_say_so():
    with pytest.raises(RequestError, match="does not accept messages"):
        parse_request({"messages": np.array([b'[{"role": "user", "content": "x"}]'], dtype=object)}, {}, CFG)


TOOLS = '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]'
ASK = '[{"role": "user", "content": "weather?"}]'


def _tool_template():
    from icekv.chat_template import ChatTemplate

    return ChatTemplate("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>"
                        "{% endfor %}|{% endfor %}", {})


def test_tools_are_rendered_and_a_forced_choice_becomes_a_grammar():
    from icekv.chat_template import ChatTemplate

    template = _tool_template()
    auto = parse_request({}, {"messages": ASK, "tools": TOOLS}, CFG, template.render)
    assert auto.text == "[get_weather]user:weather?|" and auto.sampling.grammar is None
    forced = parse_request({}, {"messages": ASK, "tools": TOOLS, "tool_choice": "get_weather",
                                "parallel_tool_calls": False}, CFG, template.render)
    assert '"const": "get_weather"' in forced.sampling.grammar and "call)*" not in forced.sampling.grammar
    uncalled = {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    hidden = parse_request({}, uncalled, CFG, template.render)
    assert hidden.text == "user:weather?|" and hidden.sampling.grammar is None
    # shown, not to be called: the prompt is the one the conversation's calling turns share
    shows = replace(CFG, tools_shown_when_none=True)
    assert parse_request({}, uncalled, shows, template.render).text == auto.text
    plain = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}", {})  # shows no tools
    assert parse_request({}, uncalled, shows, plain.render).text == "user:weather?|"  # nothing to call: no refusal
    with pytest.raises(RequestError, match="does not render tools"):
        parse_request({}, {"messages": ASK, "tools": TOOLS}, shows, plain.render)
    called = ('[{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
              '"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]}, '
              '{"role": "tool", "tool_call_id": "c", "content": "18 C"}]')
    turn = parse_request({}, {"messages": called, "tools": TOOLS}, CFG, template.render)
    assert turn.text == '[get_weather]assistant:<get_weather {"city": "Paris"}>|tool:18 C|'


@pytest.mark.parametrize("params, message", [
    ({"text_input": "x", "tools": TOOLS}, "tools are offered in a chat"),
    ({"messages": ASK, "tools": "{"}, "tools is not valid JSON"),
    ({"messages": ASK, "tools": '[{"type": "function", "function": {}}]'}, r"tools\[0\] must be"),
    ({"messages": ASK, "tools": TOOLS[:-1] + ", " + TOOLS[1:]}, "given twice"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "get_rain"}, "'get_rain', which is not among the tools"),
    ({"messages": ASK, "tool_choice": "required"}, "needs tools"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "json_schema": "{}"}, "cannot also be held"),
    ({"messages": ASK, "tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls must be true or false"),
    ({"messages": '[{"role": "user", "content": "x", "tool_calls": []}]', "tools": TOOLS}, "only an assistant"),
    ({"messages": '[{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", '
                  '"arguments": "[1]"}}]}]'}, "arguments must be a JSON object"),
])
def test_bad_tools_are_refused(params, message):
    with pytest.raises(RequestError, match=message):
        parse_request({}, params, CFG, _tool_template().render)


def test_a_template_without_tools_refuses_them():
    with pytest.raises(RequestError, match="does not render tools"):
        parse_request({}, {"messages": ASK, "tools": TOOLS}, CFG, _template().render)
