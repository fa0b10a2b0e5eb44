"""Properties of turning a generate request's fields into its settings (:func:`icekv.serving.request.parse_request`):
any fields, of any type, sent as Triton tensors or as request parameters, either give a request
whose settings are exactly the values sent (or the documented defaults where none is sent), or are
refused with RequestError, the one error the server answers with a 400 (anything else is a 500,
and a client must never be able to cause one). Fields drawn within their documented ranges are
never refused."""

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from icekv.chat_template import ChatTemplate
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.serving import ServingConfig
from icekv.policies import policy_names
from icekv.serving.fields import FIELDS
from icekv.serving.request import INPUT_NAMES, SAMPLING_FIELDS, RequestError, parse_request

SETTINGS = settings(deadline=None, derandomize=True, database=None, max_examples=300)
CFG = ServingConfig()
TYPES = {f.name: f.triton_type for f in FIELDS}
TEMPLATE = ChatTemplate("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}", {})
MESSAGES = json.dumps([{"role": "user", "content": "hi"}])
TOOLS = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])

ANY = st.recursive(st.none() | st.booleans() | st.integers() | st.sampled_from([2**70, -10**400]) | st.floats()
                   | st.text(max_size=10) | st.sampled_from(["", " ", "auto", "none", "required", "f", "icecache",
                                                            "kv2", "[]", "{}", "{", '{"1": 2}', MESSAGES, TOOLS,
                                                            "0" * 64, '{"7": ' + "9" * 5000 + "}", "[" * 3000]),
                   lambda inner: st.lists(inner, max_size=3), max_leaves=4)
JSON_TEXT = st.sampled_from(["{", "[]", "[" * 3000, "9" * 5000, "[" + "9" * 5000 + "]", '{"1": ' + "9" * 5000 + "}",
                             '{"1": 1e999}', '{"1": NaN}', '{"1": -1e308}'])


def _tensor(name: str, value):
    """``value`` as the Triton input ``name`` arrives: an array of its type (a value of another type
    as it would be sent: a string tensor of its text, a number tensor of a string refused here)."""
    kind = TYPES[name]
    values = value if isinstance(value, list) else [value]
    if kind == "TYPE_STRING":
        return np.array([str(v).encode() for v in values], dtype=object)
    dtype = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_}[kind]
    try:
        with np.errstate(over="ignore"):  # a float past fp32's range is sent as inf
            return np.array(values, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        return None  # not sendable as this tensor


def _sent(inputs: dict, params: dict) -> dict:
    """What the request carries per field, tensors first, as Python values (what parse_request reads)."""
    fields = {k: v for k, v in params.items() if k in INPUT_NAMES}
    for name, array in inputs.items():
        value = [v.decode() if isinstance(v, bytes) else v.item() for v in array.flatten()]
        fields[name] = value[0] if len(value) == 1 else value
    return fields


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _check_settings(req, fields: dict) -> None:
    """Every setting of ``req`` is what ``fields`` sent, or the documented default."""
    defaults = SamplingConfig()
    for name, _ in SAMPLING_FIELDS:
        sent = fields.get(name)
        expected = getattr(defaults, name) if sent is None else float(sent) if name in (
            "temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty") else sent
        assert _same(getattr(req.sampling, name), expected), name
    assert req.sampling.max_tokens == fields.get("max_tokens", CFG.default_max_tokens)
    stop = fields.get("stop")
    assert req.sampling.stop == (() if not stop else tuple(stop) if isinstance(stop, list) else (stop,))
    bias = json.loads(fields["logit_bias"]) if "logit_bias" in fields else {}
    assert req.sampling.logit_bias == tuple((int(k), float(v)) for k, v in bias.items())
    assert req.stream == fields.get("stream", False)
    assert req.caching == PromptCaching(fields.get("cache_prompt", True), float(fields.get("cache_retention_s", 0.0)))
    assert req.context_key == fields.get("context_key")
    if "policy" in fields or "budget" in fields:
        assert req.plan.selection.policy == fields.get("policy", CFG.engine.selection.policy)
        assert req.plan.selection.budget == fields.get("budget", CFG.engine.selection.budget)
    else:
        assert req.plan is None
    if "text_input" in fields:
        assert req.text == fields["text_input"]
    elif "messages" in fields:
        assert req.text is not None and req.text.endswith("user:hi|")
    else:
        assert req.text is None
    if "context" in fields or "context_ids" in fields:
        ids = fields.get("context_ids")
        assert (req.context.text, req.context.ids) == ((fields["context"], None) if "context" in fields else (
            None, tuple(ids) if isinstance(ids, list) else (ids,)))
        assert req.context.method == fields.get("kv_method", CFG.compression.method)
        assert req.context.kv_budget == round(float(fields.get("kv_budget", CFG.compression.kv_budget)), 6)
    else:
        assert req.context is None


def _parse(inputs: dict, params: dict):
    """The request, or None when it is refused with RequestError (any other exception fails the test)."""
    try:
        return parse_request(inputs, params, CFG, TEMPLATE.render)
    except RequestError as e:
        assert str(e)
        return None


@SETTINGS
@given(drawn=st.dictionaries(st.sampled_from(sorted(INPUT_NAMES - {"messages"}) + ["bogus", "triton_x"]),
                             ANY | JSON_TEXT, max_size=6),
       as_tensor=st.sets(st.sampled_from(sorted(INPUT_NAMES))), prompt=st.sampled_from(["text_input", "messages"]))
def test_any_fields_give_their_settings_or_a_request_error(drawn, as_tensor, prompt):
    params = {prompt: "hello" if prompt == "text_input" else MESSAGES, **drawn}
    inputs = {}
    for name in as_tensor & set(params) & INPUT_NAMES:
        tensor = _tensor(name, params[name])
        if tensor is not None:
            inputs[name] = tensor
            params[name] = "the tensor wins"  # the parameter of the same name is overridden
    req = _parse(inputs, params)
    if req is not None:
        assert not any(k not in INPUT_NAMES and not k.startswith("triton_") for k in params)
        _check_settings(req, _sent(inputs, params))


VALID = {
    "max_tokens": st.integers(1, CFG.max_tokens_limit),
    "temperature": st.floats(0, 100),
    "top_p": st.floats(0, 1, exclude_min=True),
    "seed": st.integers(-2**63, 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 10, exclude_min=True),
    "logprobs": st.integers(0, 20),
    "prompt_logprobs": st.integers(0, 20),
    "stop": st.lists(st.text(min_size=1, max_size=CFG.max_stop_chars), max_size=CFG.max_stop_sequences),
    "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 9_999_999_999).map(str), st.floats(-100, 100), max_size=5).map(
        json.dumps),
    "json_schema": st.text(max_size=10),
    "policy": st.sampled_from(policy_names()),
    "budget": st.integers(4, 1 << 20).map(lambda pages: pages * 16),
    "context_key": st.text("0123456789abcdef", min_size=64, max_size=64),
    "cache_prompt": st.just(True),
    "cache_retention_s": st.floats(0, CFG.max_cache_retention_s),
}


@SETTINGS
@given(drawn=st.fixed_dictionaries({}, optional=VALID),
       context=st.none() | st.fixed_dictionaries({"context": st.text(min_size=1).filter(str.strip)}, optional={
           "kv_method": st.sampled_from(["kv2", "kvzip", "snapkv", "keydiff", "streaming"]),
           "kv_budget": st.floats(1e-6, 1)}),
       prompt=st.sampled_from(["text_input", "messages"]))
def test_fields_within_their_documented_ranges_are_taken_as_sent(drawn, context, prompt):
    params = {prompt: "hello" if prompt == "text_input" else MESSAGES, **drawn, **(context or {})}
    req = parse_request({}, params, CFG, TEMPLATE.render)
    _check_settings(req, params)


@SETTINGS
@given(name=st.text(min_size=1, max_size=12).filter(lambda n: n not in INPUT_NAMES and not n.startswith("triton_")),
       value=ANY)
def test_an_unknown_field_is_refused_by_name(name, value):
    try:
        parse_request({}, {"text_input": "x", name: value}, CFG)
    except RequestError as e:
        assert repr(name) in str(e)
    else:
        raise AssertionError(f"{name!r} was taken")


def test_numbers_past_a_float_or_json_nested_past_the_recursion_limit_are_request_errors():
    """Regression: 10**400 as a float field, a 5000-digit number in logit_bias or messages, and
    messages nested 100000 deep raised OverflowError, ValueError and RecursionError (a 500)."""
    for params in ({"text_input": "x", "temperature": 10**400}, {"text_input": "x", "cache_retention_s": -10**400},
                   {"text_input": "x", "logit_bias": '{"1": ' + "9" * 5000 + "}"},
                   {"messages": '[{"role": "user", "content": "x", "n": ' + "9" * 5000 + "}]"},
                   {"messages": "[" * 100_000}, {"messages": MESSAGES, "tools": "[" * 100_000},
                   {"context": "c", "kv_budget": 10**400, "text_input": "x"}):
        assert _parse({}, params) is None, params
