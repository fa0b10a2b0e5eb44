"""OpenAI's response shapes: a choice, a streamed delta, tool calls, usage, log-probabilities, and
icekv's own statistics beside them."""

from __future__ import annotations

import json
import uuid
from itertools import accumulate

from icekv.serving.client import Final
from icekv.serving.tool_calls import ToolCall
from icekv.serving.tool_formats import ToolFormat, split_calls


def usage(finals: list[Final], n: int = 1) -> dict:
    """A request's usage over its choices (``n`` per prompt, in order): each prompt counted once
    (its first choice's), every choice's new tokens."""
    firsts = finals[::n]
    prompt, completion = sum(f.prompt_tokens for f in firsts), sum(f.new_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)}}


def final_logprobs(final: Final, with_prompt: bool = False) -> list:
    """The request's per-token log-probabilities, as the engine reported them; ``with_prompt``:
    its prompt's first (an echo's)."""
    prompt = json.loads(final.prompt_logprobs) if with_prompt and final.prompt_logprobs else []
    return prompt + (json.loads(final.logprobs) if final.logprobs else [])


def icekv_stats(final: Final) -> dict:
    """icekv's own account of the request's KV cache (extra response field; OpenAI clients ignore it)."""
    stats = {"policy": final.policy, "budget": final.budget, "kv_resident_bytes": final.kv_resident_bytes,
             "kv_total_bytes": final.kv_total_bytes, "kv_bytes_moved": final.kv_bytes_moved}
    if final.context_key:
        stats.update(context_key=final.context_key, context_cache=final.context_cache)
    return stats


def call_entry(call: ToolCall, index: int | None = None) -> dict:
    """A tool call as a message's ``tool_calls`` entry (streamed: with its ``index`` in the message)."""
    entry = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
    return entry if index is None else {"index": index, **entry}


def called(finish_reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when an answer that ended by itself called tools."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


class ToolDeltas:
    """One streamed chat choice's text -> its deltas' content and ``tool_calls`` entries, each call
    whole as it closes (``parallel`` false: the first call only), read in the model's ``tool_format``."""

    def __init__(self, tool_format: ToolFormat, names: list[str], parallel: bool):
        self._stream, self._parallel = tool_format.stream(names), parallel
        self.calls = 0

    def feed(self, text: str) -> list[str | dict]:
        return self._entries(self._stream.feed(text))

    def finish(self) -> list[str | dict]:
        return self._entries(self._stream.finish())

    def _entries(self, parts: list) -> list[str | dict]:
        out = []
        for part in parts:
            if isinstance(part, str):
                out.append(part)
            elif self._parallel or not self.calls:
                out.append(call_entry(part, self.calls))
                self.calls += 1
        return out


def answer_calls(text: str, tool_format: ToolFormat, names: list[str], parallel: bool
                 ) -> tuple[str | None, list[ToolCall]]:
    """A whole chat answer's content and the calls it made (``parallel`` false: the first only)."""
    content, calls = split_calls(text, names, tool_format)
    return content, calls if parallel else calls[:1]


class Kind:
    """What differs between the chat and the completion endpoints' responses."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.prefix = "chatcmpl" if chat else "cmpl"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, index: int, text: str | None, finish_reason: str | None, logprobs: list | None = None,
               calls: list[ToolCall] = ()) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [call_entry(c) for c in calls]
            return {"index": index, "message": message, "logprobs": self.logprobs(logprobs),
                    "finish_reason": called(finish_reason, bool(calls))}
        return {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def delta(self, index: int, text: str | None, finish_reason: str | None, first: bool = False,
              logprobs: list | None = None, calls: dict | None = None) -> dict:
        """A streamed chunk's choice: text, or (chat) ``calls``, a delta's ``tool_calls`` entry."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            if calls is not None:
                delta = {"tool_calls": [calls]}
            return {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def logprobs(self, tokens: list | None) -> dict | None:
        """The engine's per-token log-probabilities (None: not asked) in this endpoint's shape:
        chat's ``content`` list, or the completions API's parallel lists."""
        if tokens is None:
            return None
        if self.chat:
            entry = lambda t: {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}  # noqa: E731
            return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t["top_logprobs"]]} for t in tokens],
                    "refusal": None}
        offsets = list(accumulate((len(t["token"]) for t in tokens[:-1]), initial=0))[: len(tokens)]
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [None if t["logprob"] is None else {a["token"]: a["logprob"] for a in t["top_logprobs"]}
                                 for t in tokens],  # the first token of an echoed prompt has none
                "text_offset": offsets}
