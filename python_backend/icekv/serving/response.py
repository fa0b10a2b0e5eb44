"""The icekv model's responses, declared once: config.pbtxt's outputs, what the model sends and
what clients read all come from :class:`Final` and :data:`TEXT_OUTPUT`.

A request's text goes out in ``text_output`` (streamed pieces, or the whole text in its last
response); its last response also carries every field of :class:`Final`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

TEXT_OUTPUT = ("text_output", "TYPE_STRING")


def _out(default, triton_type: str):
    return field(default=default, metadata={"triton": triton_type})


@dataclass(frozen=True)
class Final:
    """The last response of a request: why it ended, usage and KV statistics."""

    finish_reason: str = _out("", "TYPE_STRING")  # length | stop | context_ready | healthy
    prompt_tokens: int = _out(0, "TYPE_INT32")
    cached_tokens: int = _out(0, "TYPE_INT32")  # of the prompt's, held by the prefix cache (not prefilled)
    new_tokens: int = _out(0, "TYPE_INT32")
    policy: str = _out("", "TYPE_STRING")
    budget: int = _out(0, "TYPE_INT32")  # 0 under full attention
    kv_resident_bytes: int = _out(0, "TYPE_INT64")
    kv_total_bytes: int = _out(0, "TYPE_INT64")
    kv_bytes_moved: int = _out(0, "TYPE_INT64")
    context_key: str = _out("", "TYPE_STRING")  # the request's context ("" without one) ...
    context_cache: str = _out("", "TYPE_STRING")  # ... found (hit), compressed for it, or joined another's compression
    logprobs: str = _out("", "TYPE_STRING")  # asked for: a JSON list, per new token (icekv.engine.sampling.token_logprobs)
    prompt_logprobs: str = _out("", "TYPE_STRING")  # asked for: the same, per prompt token (the first's logprob null)
    tool_format: str = _out("", "TYPE_STRING")  # a health answer's: how the model writes tool calls (tool_formats)


OUTPUTS = (TEXT_OUTPUT, *((f.name, f.metadata["triton"]) for f in fields(Final)))  # name, Triton type
