"""Every field a generate request may carry, declared once: the icekv model's Triton inputs
(config.pbtxt), icekv's own fields of the OpenAI bodies (sent as extras beside OpenAI's), and the
request table of docs/serving.md (a test keeps it equal) all come from :data:`FIELDS`. Defaults
are the configs' (:class:`icekv.config.request.SamplingConfig`, ``PromptCaching``,
``ServingConfig``), applied where a request is parsed (:mod:`icekv.serving.request`).
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1

# a config.pbtxt data type -> its name in the docs, and its Python type in a JSON body
TYPE_NAMES = {"TYPE_STRING": "string", "TYPE_INT32": "int32", "TYPE_INT64": "int64", "TYPE_FP32": "fp32",
              "TYPE_BOOL": "bool"}
PYTHON_TYPES = {"TYPE_STRING": str, "TYPE_INT32": int, "TYPE_INT64": int, "TYPE_FP32": float, "TYPE_BOOL": bool}


@dataclass(frozen=True)
class RequestField:
    """One request field: its Triton type and dims, what it means (the docs' words) and, for the
    fields of icekv's own that the OpenAI API carries as extras, their bounds there (pydantic
    ``Field`` constraints; OpenAI's own fields, such as ``temperature``, keep OpenAI's names and
    limits in the OpenAI bodies)."""

    name: str
    triton_type: str
    meaning: str
    dims: str = "[ 1 ]"
    openai_extra: dict | None = None  # an extra of the OpenAI bodies, with these bounds; None: not one

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.triton_type] + (" list" if self.dims == "[ -1 ]" else "")

    @property
    def python_type(self) -> type:
        return PYTHON_TYPES[self.triton_type]


FIELDS = (
    RequestField("text_input", "TYPE_STRING", "the prompt, sent to the model as is"),
    RequestField("messages", "TYPE_STRING", "instead of `text_input`: a JSON list of `{\"role\", \"content\"}` chat "
                 "messages, rendered with the model's chat template (content: a string or a list of "
                 "`{\"type\": \"text\", \"text\"}` parts)"),
    RequestField("max_tokens", "TYPE_INT32", "new tokens at most (default `default_max_tokens`, at most "
                 "`max_tokens_limit`)"),
    RequestField("stream", "TYPE_BOOL", "send each text piece as it is decoded"),
    RequestField("temperature", "TYPE_FP32", "sampling temperature; 0 is greedy"),
    RequestField("top_p", "TYPE_FP32", "nucleus sampling: the smallest set of tokens whose probability reaches it"),
    RequestField("seed", "TYPE_INT64", "the sampling seed"),
    RequestField("presence_penalty", "TYPE_FP32", "in [-2, 2], as OpenAI defines it: subtracted from a token's "
                 "logit once if it was generated"),
    RequestField("frequency_penalty", "TYPE_FP32", "in [-2, 2], as OpenAI defines it: subtracted from a token's "
                 "logit once per time it was generated"),
    RequestField("repetition_penalty", "TYPE_FP32", "in (0, 10], as vLLM and Hugging Face define it: every token of "
                 "the prompt and the output has its logit divided by it (positive) or multiplied (negative); 1 is off",
                 openai_extra=dict(gt=0, le=10)),
    RequestField("logit_bias", "TYPE_STRING", "a JSON object of token ids (decimal strings) to biases in [-100, 100] "
                 "added to their logits, at most 300"),
    RequestField("json_schema", "TYPE_STRING", "a JSON schema (JSON text): the output is JSON valid under it, held "
                 "there by masking the logits each step (llguidance); a schema it cannot compile gets a 400 naming "
                 "the problem"),
    RequestField("tools", "TYPE_STRING", "with `messages`: a JSON list of OpenAI function tools (`{\"type\": "
                 "\"function\", \"function\": {\"name\", \"description\", \"parameters\"}}`), shown to the model "
                 "through its chat template; a template that cannot show tools (the embedded SmolLM2's) gets a 400"),
    RequestField("tool_choice", "TYPE_STRING", "`auto` (the default with tools), `none` (no call; the tools are "
                 "left out of the prompt unless `tools_shown_when_none`), `required`, or a function's name: the "
                 "last two make the output tool calls, held to the model's call format (`tool_format`) with "
                 "arguments that satisfy the function's `parameters` (a Lark grammar, llguidance; a delimiter the "
                 "vocabulary holds as one token is written as that token, otherwise as text); the text comes back "
                 "raw, the OpenAI API parses it"),
    RequestField("parallel_tool_calls", "TYPE_BOOL", "default true; false: under `tool_choice: required` the output is "
                 "one call (and the OpenAI API returns only the first call); a function named by `tool_choice` is "
                 "always called once"),
    RequestField("logprobs", "TYPE_INT32", "in [0, 20]: report each sampled token's log-probability (an "
                 "end-of-sequence token's too, as vLLM does) and this many likeliest alternatives (the model's own "
                 "distribution, before penalties, bias and temperature) in the last response's `logprobs`"),
    RequestField("prompt_logprobs", "TYPE_INT32", "in [0, 20]: the same for every prompt token, in "
                 "`prompt_logprobs` (the first token's `logprob` is null: nothing predicts it; the prompt is then "
                 "prefilled whole, never from the prefix cache)"),
    RequestField("stop", "TYPE_STRING", "stop strings (not included in the output)", dims="[ -1 ]"),
    RequestField("policy", "TYPE_STRING", "this request's decode method (default: the server's `policy`)",
                 openai_extra={}),
    RequestField("budget", "TYPE_INT32", "this request's tokens attended per layer per KV head (default: the "
                 "server's `budget`); every other selection setting stays the server's",
                 openai_extra=dict(ge=1, le=INT32_MAX)),
    RequestField("context_key", "TYPE_STRING", "a context already compressed (by this server, a replica sharing "
                 "its store, or `icekv compress`), by its key; with `context` too, the two must agree",
                 openai_extra={}),
    RequestField("context", "TYPE_STRING", "a reusable context (document, system prompt): compressed once per key, "
                 "then shared", openai_extra={}),
    RequestField("context_ids", "TYPE_INT32", "instead of `context`: its token ids", dims="[ -1 ]"),
    RequestField("kv_method", "TYPE_STRING", "how `context` is compressed: `kv2` (default), `kvzip`, `snapkv`, "
                 "`keydiff`, `streaming`", openai_extra={}),
    RequestField("kv_budget", "TYPE_FP32", "the share of `context`'s KV kept, in (0, 1] (default 0.05)",
                 openai_extra=dict(gt=0, le=1)),
    RequestField("cache_prompt", "TYPE_BOOL", "default true; false: the prefix cache neither serves this prompt "
                 "nor keeps its pages ([prefix cache](#prefix-cache))", openai_extra={}),
    RequestField("cache_retention_s", "TYPE_FP32", "keep this request's cached pages ahead of the LRU order for "
                 "this many seconds after it ends, at most `max_cache_retention_s` (600)",
                 openai_extra=dict(ge=0)),
    RequestField("health", "TYPE_BOOL", "answered at once, without queueing: `finish_reason` `healthy` while the "
                 "engine thread runs, an internal error once it has stopped (the frontend's readiness and liveness "
                 "routes send it)"),
)
NAMES = frozenset(f.name for f in FIELDS)
OPENAI_EXTRAS = tuple(f for f in FIELDS if f.openai_extra is not None)


def docs_table() -> str:
    """docs/serving.md's table of the generate endpoints' inputs (Markdown)."""
    rows = ["| input | type | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.type_name} | {f.meaning} |" for f in FIELDS]
    return "\n".join(rows) + "\n"
