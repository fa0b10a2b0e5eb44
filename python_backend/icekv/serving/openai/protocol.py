"""The OpenAI request bodies icekv accepts, and OpenAI-shaped errors.

Bodies are validated strictly (no string-to-number coercion, unknown fields refused, as the
OpenAI API does); the few options icekv does not implement (``best_of``, ``suffix``) are accepted
only at their neutral value. Tools are OpenAI's function tools, shown to the model through its
chat template (:mod:`icekv.serving.tool_calls` reads its calls back). icekv's own settings
(``policy``, ``budget``, ``context``, ``context_key``, ``kv_method``, ``kv_budget``, ...) ride
along as extra body fields.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, ValidationError, ValidationInfo, create_model, field_validator, model_validator

from icekv.config.request import MAX_TOP_LOGPROBS
from icekv.serving.fields import INT32_MAX, OPENAI_EXTRAS
from icekv.serving.openai.messages import ChatMessage, NamedToolChoice, Strict, Tool
from icekv.serving.openai.response_format import ResponseFormat
from icekv.serving.tool_calls import CHOICES as TOOL_CHOICES

MAX_CHOICES = 16  # n per request
MAX_TOOLS = 128  # functions per request, as OpenAI allows
INT64_MAX = 2**63 - 1


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
             413: "invalid_request_error", 499: "invalid_request_error", 500: "server_error",
             503: "service_unavailable_error", 504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(Strict):
    include_usage: bool = False


# icekv's own request fields (and vLLM's repetition_penalty), as extras of both bodies: declared once
# in icekv.serving.fields, each None unless sent (the server's default then applies)
IcekvExtras = create_model("IcekvExtras", __base__=Strict, **{
    f.name: (Optional[Annotated[f.python_type, Field(**f.openai_extra)]], None) for f in OPENAI_EXTRAS})


class RouterFields(Strict):
    """Fields the SGLang Model Gateway writes into every body it forwards (it rebuilds a request
    from its own schema), accepted at the values that ask for nothing icekv lacks."""

    no_stop_trim: Literal[False] | None = None
    ignore_eos: Literal[False] | None = None
    skip_special_tokens: Literal[True] | None = None
    return_hidden_states: Literal[False] | None = None


class _GenerateBody(IcekvExtras, RouterFields):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # OpenAI's sampling fields
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices; 2 and more share the prompt's cached pages
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # JSON mode or a JSON schema: constrained decoding

    @field_validator("stop")
    @classmethod
    def _stop_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token the client asked for; None: no log-probabilities."""
        return None

    @property
    def echoes_prompt(self) -> bool:
        """Does each choice start with its prompt (and its logprobs with the prompt's)?"""
        return False

    @property
    def shares_prompt(self) -> bool:
        """May a prompt's choices share its cached pages? Not when the prefix cache is skipped, or
        when every prompt token is scored (each choice then prefills its prompt whole)."""
        return self.cache_prompt is not False and not (self.echoes_prompt and self.top_logprobs_asked is not None)

    def echoed(self, index: int) -> str:
        """What choice ``index``'s text starts with: its prompt when echoed, else nothing."""
        return ""

    @property
    def choice_count(self) -> int:
        """Choices in the response: ``n`` per prompt."""
        return self.n * self.prompt_count

    @property
    def prompt_count(self) -> int:
        return 1

    def choice_fields(self, index: int) -> dict[str, Any]:
        """The inputs of choice ``index``, OpenAI's order (prompt ``index // n``, its choice ``index
        % n``): that prompt's request, its seed (if one was sent) moved by the choice so that
        sampled choices differ and still repeat."""
        fields = self.triton_fields(index // self.n)
        if self.seed is not None and index % self.n:
            fields["seed"] = (self.seed + index % self.n + 2**63) % 2**64 - 2**63  # stays an int64
        return fields

    def triton_fields(self, prompt: int = 0) -> dict[str, Any]:
        """The icekv model's inputs for this body (absent settings take the server's defaults)."""
        fields = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": self.seed, "stop": self.stop or None, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty,
                  "logit_bias": None if self.logit_bias is None else json.dumps(self.logit_bias),
                  "json_schema": None if self.response_format is None else self.response_format.schema_text(),
                  "logprobs": self.top_logprobs_asked, "stream": True,
                  **{f.name: getattr(self, f.name) for f in OPENAI_EXTRAS}}
        return {k: v for k, v in fields.items() if v is not None}


class ChatCompletionBody(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # more of the SGLang Model Gateway's fields (see RouterFields): icekv has no reasoning parser,
    # so the reasoning switches change nothing, as in SGLang started without one
    continue_final_message: Literal[False] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_among_the_tools(cls, choice, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if choice not in (None, "none") and not names:
            raise ValueError("only allowed when tools are given")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ValueError(f"the function {choice.function.name!r} is not among the tools")
            if choice.function.name in TOOL_CHOICES:
                raise ValueError(f"a function named {choice.function.name!r} cannot be chosen by name "
                                 "(the word is a tool_choice)")
        return choice

    @model_validator(mode="after")
    def _one_grammar(self):
        forced = self.tools and self.tool_choice not in (None, "none", "auto")
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a forced tool call cannot also be held to response_format; send one of them")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or ()]

    @property
    def calls_tools(self) -> bool:
        """May the answer call tools (its text is then parsed for calls)?"""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parallel_calls(self) -> bool:
        """May one answer make several calls (OpenAI's default)?"""
        return self.parallel_tool_calls is not False

    @model_validator(mode="after")
    def _one_token_limit(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self

    def triton_fields(self, prompt: int = 0) -> dict[str, Any]:
        fields = {**super().triton_fields(), "messages": json.dumps([m.for_template() for m in self.messages])}
        if self.tools:
            fields["tools"] = json.dumps([t.model_dump(exclude_none=True) for t in self.tools])
        if self.tool_choice is not None:
            choice = self.tool_choice
            fields["tool_choice"] = choice.function.name if isinstance(choice, NamedToolChoice) else choice
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        return fields


class CompletionBody(_GenerateBody):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt before the answer, and with logprobs each prompt token's too
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = v if isinstance(v, list) else [v]
        if not 1 <= len(prompts) <= MAX_CHOICES:
            raise ValueError(f"send 1 to {MAX_CHOICES} prompts, got {len(prompts)}")
        if any(not p.strip() for p in prompts):
            raise ValueError("prompt is empty")
        return prompts

    @model_validator(mode="after")
    def _choices_bounded(self):
        if self.choice_count > MAX_CHOICES:
            raise ValueError(f"prompts x n is at most {MAX_CHOICES} choices, got {self.choice_count}")
        return self

    @property
    def prompt_count(self) -> int:
        return len(self.prompt)

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    def echoed(self, index: int) -> str:
        return self.prompt[index // self.n] if self.echo else ""

    def triton_fields(self, prompt: int = 0) -> dict[str, Any]:
        scored = {"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}
        return {**super().triton_fields(), "text_input": self.prompt[prompt], **scored}


def _param(loc: tuple) -> str | None:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def parse_body(model: type[_GenerateBody], raw: bytes, max_stop: int) -> _GenerateBody:
    """Validate a request body; OpenAIError(400) naming the first offending field otherwise."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = tuple(p for p in first["loc"] if p not in ("function-after", "str", "list[str]", "list[TextPart]",
                                                          "NamedToolChoice") and not str(p).startswith("literal["))
        kind, message = first["type"], first["msg"].removeprefix("Value error, ")
        if kind == "json_invalid":
            raise OpenAIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}") from None
        if kind == "model_type" or kind == "model_attributes_type":
            raise OpenAIError(400, "the body must be a JSON object") from None
        if kind == "extra_forbidden":
            raise OpenAIError(400, f"unrecognized request argument: {_param(loc)}", _param(loc)) from None
        if kind == "literal_error" and loc and loc[-1] in model.model_fields:
            message = f"icekv supports only {first['ctx']['expected']}"
        if loc == ("tool_choice",) and kind != "value_error":  # the unions' first branch's complaint would hide the second
            message = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        if "content" in loc:
            message = 'a message\'s content must be a string or a list of {"type": "text", "text": ...} parts'
        where = _param(loc)
        raise OpenAIError(400, f"{where}: {message}" if where else message, where) from None
    if body.stop and len(body.stop) > max_stop:
        raise OpenAIError(400, f"stop: at most {max_stop} stop sequences, got {len(body.stop)}", "stop")
    return body
