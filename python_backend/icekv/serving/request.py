"""Turn a Triton request's inputs and parameters into a validated :class:`GenerateRequest`.

Every field may arrive as an input tensor (tritonclient, or a top-level key of the generate
endpoint's JSON) or as a request parameter (the JSON ``parameters`` object); the tensor wins.
Anything wrong raises :class:`RequestError` with a message the client sees as an HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from icekv.compress.methods import COMPRESSORS
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.selection import REQUEST_SETTINGS
from icekv.config.serving import CompressionConfig, ServingConfig, check_kv_budget
from icekv.errors import ConfigError, IcekvError
from icekv.chat_template import ChatTemplateError, normalize_tools
from icekv.policies import PolicyPlan, resolve
from icekv.serving.fields import NAMES
from icekv.serving.tool_calls import ToolCallError, tool_choice
from icekv.serving.tool_formats import ModelToolCalls
from icekv.store.format import StoreError, check_key
from icekv.json_text import JSONTextError, read_json

TRITON_PREFIX = "triton_"  # request parameters Triton itself reads (e.g. triton_enable_empty_final_response)
INPUT_NAMES = NAMES - {"health"}  # a request's fields (health: a probe)


MAX_LOGIT_BIAS = 300  # token ids one request may bias, as OpenAI allows


class RequestError(IcekvError, ValueError):
    """The client sent something invalid (HTTP 400 / INVALID_ARG)."""


@dataclass(frozen=True)
class ContextRequest:
    """A reusable context sent with the request: compressed once, then found by its key."""

    text: str | None  # the context as text, or
    ids: tuple[int, ...] | None  # as token ids
    method: str
    kv_budget: float


@dataclass(frozen=True)
class GenerateRequest:
    text: str | None  # None: the request only compresses its context
    sampling: SamplingConfig
    plan: PolicyPlan | None  # the request's own method and budget; None: the server's
    stream: bool
    context_key: str | None
    context: ContextRequest | None = None
    prompt_ids: list[int] | None = None  # ``text`` tokenized, when a server thread has done it already
    caching: PromptCaching = PromptCaching()  # what the prefix cache may do with its prompt


def _scalar(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size != 1:
            return [_scalar(v) for v in value.flatten()]
        value = value.flatten()[0]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("string inputs must be UTF-8") from None
    return value.item() if isinstance(value, np.generic) else value


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range (not printed: it may be past Python's str limit too)
        raise RequestError(f"{name} must be a number, got an integer too large for one") from None


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {value!r}")
    return value


def _json(name: str, value: Any) -> Any:
    """The string field ``name`` read as JSON; RequestError naming why where it cannot be."""
    try:
        return read_json(_str(name, value))
    except JSONTextError as e:
        raise RequestError(f"{name} is not valid JSON: {e}") from None


# the request fields that are SamplingConfig's fields of the same name, and how each is read
SAMPLING_FIELDS = (("temperature", _float), ("top_p", _float), ("seed", _int), ("presence_penalty", _float),
                   ("frequency_penalty", _float), ("repetition_penalty", _float), ("logprobs", _int),
                   ("prompt_logprobs", _int), ("json_schema", _str))


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return bool(value)


@dataclass(frozen=True)
class ToolUse:
    """The functions a chat request offers the model, and how it may call them."""

    tools: list[dict] | None  # shown to the model (None: none offered, or none shown under tool_choice none)
    grammar: str | None  # the Lark grammar that makes it call (tool_choice required, or one function)
    may_call: bool = True  # False under tool_choice none: the tools, if shown, are shown where the template can


def _tool_use(fields: dict[str, Any], tool_calls: ModelToolCalls, shown_when_none: bool) -> ToolUse:
    """``tools`` (a JSON list of OpenAI function tools), ``tool_choice`` (none, auto, required or a
    function's name) and ``parallel_tool_calls`` checked together; a forced call's grammar in the
    model's format (``tool_calls``); under none, the tools only if ``shown_when_none``."""
    tools = None
    if "tools" in fields:
        try:
            tools = normalize_tools(_json("tools", fields["tools"]))
        except ChatTemplateError as e:
            raise RequestError(str(e)) from None
        if "messages" not in fields:
            raise RequestError("tools are offered in a chat: send messages, not text_input")
    parallel = _bool("parallel_tool_calls", fields.get("parallel_tool_calls", True))
    choice = fields.get("tool_choice")
    try:
        choice = tool_choice(None if choice is None else _str("tool_choice", choice), tools or [])
    except ToolCallError as e:
        raise RequestError(str(e)) from None
    if choice == "none":
        return ToolUse(tools if shown_when_none else None, None, may_call=False)
    if choice != "auto" and "json_schema" in fields:
        raise RequestError(f"tool_choice {choice} makes the output a tool call; it cannot also be held to "
                           "json_schema (response_format)")
    return ToolUse(tools, None if choice == "auto" else tool_calls.grammar(tools, choice, parallel))


def _prompt(fields: dict[str, Any], chat_prompt: Callable[..., str] | None, tool_use: ToolUse) -> str | None:
    """The prompt text: ``text_input`` as is, or ``messages`` (a JSON list) through the chat
    template with the tools; None for a request that only sends a context to compress."""
    if "text_input" in fields and "messages" in fields:
        raise RequestError("send exactly one of text_input (plain text) and messages (a JSON list of chat messages)")
    if "text_input" not in fields and "messages" not in fields:
        if "context" in fields or "context_ids" in fields:
            return None
        raise RequestError("send exactly one of text_input (plain text) and messages (a JSON list of chat messages)")
    if "text_input" in fields:
        text = _str("text_input", fields["text_input"])
        if not text.strip():
            raise RequestError("text_input is empty")
        return text
    messages = _json("messages", fields["messages"])
    if chat_prompt is None:
        raise RequestError("this server does not accept messages; send text_input")
    try:
        return chat_prompt(messages, tool_use.tools, tools_optional=not tool_use.may_call)
    except ChatTemplateError as e:
        raise RequestError(str(e)) from None


def _context(fields: dict[str, Any], cfg: CompressionConfig) -> ContextRequest | None:
    given = [name for name in ("context", "context_ids") if name in fields]
    if not given:
        for name in ("kv_method", "kv_budget"):
            if name in fields:
                raise RequestError(f"{name} applies only to a request with a context (context or context_ids)")
        return None
    if len(given) == 2:
        raise RequestError("send one of context (text) and context_ids (token ids)")
    method = _str("kv_method", fields.get("kv_method", cfg.method))
    if method not in COMPRESSORS:
        raise RequestError(f"unknown kv_method {method!r}; choose from {', '.join(COMPRESSORS)}")
    sent = _float("kv_budget", fields.get("kv_budget", cfg.kv_budget))
    budget = round(sent, 6)  # an fp32 input, rounded as the CLI's decimal flag: one key for both
    try:
        check_kv_budget(sent)
    except ConfigError as e:
        raise RequestError(str(e)) from None
    if budget == 0:
        raise RequestError(f"kv_budget must be at least 1e-06, got {sent:g}")
    if "context" in fields:
        text = _str("context", fields["context"])
        if not text.strip():
            raise RequestError("context is empty")
        return ContextRequest(text, None, method, budget)
    ids = fields["context_ids"]
    ids = ids if isinstance(ids, list) else [ids]
    return ContextRequest(None, tuple(_int("context_ids", i) for i in ids), method, budget)


def _logit_bias(fields: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: a JSON object of token id (a decimal string, as OpenAI sends it) to bias."""
    if "logit_bias" not in fields:
        return ()
    bias = _json("logit_bias", fields["logit_bias"])
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias must be a JSON object of at most {MAX_LOGIT_BIAS} token ids to biases")
    out = []
    for token, value in bias.items():
        if not (token.isascii() and token.isdigit() and len(token) <= 10):
            raise RequestError(f"logit_bias keys must be token ids, got {token!r}")
        out.append((int(token), _float(f"logit_bias[{token}]", value)))
    return tuple(out)


def _caching(fields: dict[str, Any], cfg: ServingConfig) -> PromptCaching:
    enabled = _bool("cache_prompt", fields.get("cache_prompt", PromptCaching.enabled))
    retention = _float("cache_retention_s", fields.get("cache_retention_s", PromptCaching.retention_s))
    if not 0 <= retention <= cfg.max_cache_retention_s:
        raise RequestError(f"cache_retention_s must be in [0, {cfg.max_cache_retention_s:g}] (max_cache_retention_s), "
                           f"got {retention:g}")
    if retention and not enabled:
        raise RequestError("cache_retention_s needs cache_prompt: a prompt kept out of the cache is not retained")
    return PromptCaching(enabled, retention)


def parse_request(inputs: dict[str, Any], params: dict[str, Any], cfg: ServingConfig,
                  chat_prompt: Callable[..., str] | None = None,
                  tool_calls: ModelToolCalls = ModelToolCalls()) -> GenerateRequest:
    """inputs: name -> numpy array (absent inputs omitted); params: the request's parameters;
    chat_prompt: renders ``messages`` (and tools) with the model's chat template (Engine.chat_prompt);
    tool_calls: the model's tool-call format, for a forced call's grammar."""
    unknown = sorted(k for k in params if k not in INPUT_NAMES and not k.startswith(TRITON_PREFIX))
    if unknown:  # a misspelt setting would otherwise be dropped without a word
        raise RequestError(f"unknown parameters {unknown}; the model takes {sorted(INPUT_NAMES)}")
    fields = {k: v for k, v in params.items() if k in INPUT_NAMES}
    fields.update({k: _scalar(v) for k, v in inputs.items() if v is not None})
    for name in ("text_input", "messages", "tools", "context"):
        size = len(fields[name]) if isinstance(fields.get(name), (str, bytes)) else 0
        if size > cfg.max_input_bytes:
            raise RequestError(f"{name} is {size} bytes, above this server's limit of {cfg.max_input_bytes} "
                               "(max_input_bytes)")
    tool_use = _tool_use(fields, tool_calls, cfg.tools_shown_when_none)
    text = _prompt(fields, chat_prompt, tool_use)
    max_tokens = _int("max_tokens", fields.get("max_tokens", cfg.default_max_tokens))
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > cfg.max_tokens_limit:
        raise RequestError(f"max_tokens {max_tokens} exceeds this server's limit of {cfg.max_tokens_limit}")
    stop = fields.get("stop", ())
    stop = tuple(_str("stop", s) for s in (stop if isinstance(stop, list) else [stop])) if stop else ()
    if len(stop) > cfg.max_stop_sequences:
        raise RequestError(f"at most {cfg.max_stop_sequences} stop strings per request, got {len(stop)}")
    if any(len(s) > cfg.max_stop_chars for s in stop):
        raise RequestError(f"a stop string may have at most {cfg.max_stop_chars} characters, got "
                           f"{max(map(len, stop))}")
    # what the request sets; SamplingConfig's own defaults for the rest
    given = {name: parse(name, fields[name]) for name, parse in SAMPLING_FIELDS if fields.get(name) is not None}
    try:
        sampling = SamplingConfig(max_tokens=max_tokens, stop=stop, logit_bias=_logit_bias(fields),
                                  grammar=tool_use.grammar, **given)
        # the server's selection with what the request overrides (every other setting kept), resolved
        # here once; None: the engine's own plan
        read = {"policy": _str, "budget": _int}
        overrides = {name: read[name](name, fields[name]) for name in REQUEST_SETTINGS if name in fields}
        plan = resolve(replace(cfg.engine.selection, **overrides)) if overrides else None
    except ConfigError as e:
        raise RequestError(str(e)) from None
    context_key = fields.get("context_key")
    if context_key is not None:
        try:
            context_key = check_key(_str("context_key", context_key))
        except StoreError as e:
            raise RequestError(str(e)) from None
    return GenerateRequest(text, sampling, plan, _bool("stream", fields.get("stream", False)), context_key,
                           _context(fields, cfg.compression),
                           caching=_caching(fields, cfg))
