"""Tool calls: what every format shares, and the Hermes format's reading, the one Qwen2.5's chat
template teaches (and Hermes', and many others'): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` in the
assistant's text (the other families' formats: :mod:`icekv.serving.tool_formats`).

- :func:`read_call` reads one call object, as every format writes it.
- :class:`ToolCallStream` splits streamed text into content and calls as they close, holding back
  only what may still become a call.
- :func:`tool_choice` checks a request's ``tool_choice`` against its tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Collection

from icekv.json_text import JSONTextError, read_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")  # tool_choice's keywords; any other value names a function


class ToolCallError(ValueError):
    """A request's tools or tool_choice are malformed."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


def read_call(value) -> ToolCall:
    """A call object as the formats write it: ``name``, and its arguments as an object under
    ``arguments`` (or Llama's ``parameters``; JSON text of an object is read too); ToolCallError
    saying what is wrong otherwise, never a call with its arguments dropped."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ToolCallError("a call is a JSON object with a function's name under \"name\"")
    keys = [k for k in ("arguments", "parameters") if k in value]
    if len(keys) > 1:
        raise ToolCallError(f"call {value['name']!r} holds both arguments and parameters")
    unread = sorted(set(value) - {"name", "id", "type", *keys})
    if unread:
        raise ToolCallError(f"call {value['name']!r} holds {', '.join(unread)}, which is not its arguments")
    arguments = value[keys[0]] if keys else {}
    if isinstance(arguments, str):
        try:
            arguments = read_json(arguments)
        except JSONTextError as e:
            raise ToolCallError(f"call {value['name']!r}: its arguments text is not JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"call {value['name']!r}: its arguments must be a JSON object, got "
                            f"{type(arguments).__name__}")
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _parsed(body: str) -> ToolCall | None:
    """The call a block's body holds; None when it is not one (the block then stays text)."""
    try:
        return read_call(read_json(body))
    except (JSONTextError, ToolCallError):
        return None


def _held_back(text: str) -> int:
    """How many of ``text``'s last characters may begin an OPEN still to come."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Streamed assistant text -> its content pieces (str) and its calls (ToolCall), in order.

    Text is passed on as soon as it cannot be part of a call; a block is held until it closes. A
    block whose body is not a call, or that never closes, is content. Whitespace before a call is
    dropped (the format puts newlines there), so it is held until what follows it is known.

    ``names``: the offered functions. Small models often answer with the call object alone, without
    the tags; an output that is nothing but a call to one of ``names`` is that call. So an output
    that starts with ``{`` is held to its end."""

    def __init__(self, names: Collection[str] = ()):
        self._held = ""
        self._names = set(names)
        self._bare = bool(names)  # may the whole output still be one untagged call?
        self.calls = 0

    def feed(self, piece: str) -> list[str | ToolCall]:
        self._held += piece
        if self._bare:
            start = self._held.lstrip()[:1]
            if start in ("", "{"):
                return []
            self._bare = False
        return self._split()

    def finish(self) -> list[str | ToolCall]:
        """What is left at the end of the output (an unclosed block, as text)."""
        if self._bare:
            self._bare = False
            call = _parsed(self._held)
            if call is not None and call.name in self._names:
                self._held, self.calls = "", self.calls + 1
                return [call]
        out = self._split()
        text = self._take(len(self._held))
        return out + ([text] if text.strip() or (text and not self.calls) else [])

    def _split(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                safe = self._held[: len(self._held) - _held_back(self._held)]
                if safe.strip():  # trailing whitespace waits: it is dropped if a call follows it
                    out.append(self._take(len(safe.rstrip())))
                return out
            end = self._held.find(CLOSE, start)
            if end < 0:  # the block is open: the whitespace before it waits to know whether it is a call
                text = self._held[:start].rstrip()
                if text:
                    out.append(self._take(len(text)))
                return out
            call = _parsed(self._held[start + len(OPEN): end])
            text = self._take(start)
            text = text.rstrip() if call is not None else text  # only a call's whitespace is dropped
            if text:
                out.append(text)
            block = self._take(end - start + len(CLOSE))
            out.append(block if call is None else call)
            self.calls += call is not None

    def _take(self, n: int) -> str:
        text, self._held = self._held[:n], self._held[n:]
        return text


def tool_choice(choice: str | None, tools: list[dict]) -> str:
    """``choice`` checked: ``none``, ``auto`` (the default with tools), ``required``, or the name of
    one of ``tools``."""
    if choice is None:
        return "auto" if tools else "none"
    if not tools and choice != "none":
        raise ToolCallError(f"tool_choice {choice!r} needs tools")
    names = [t["function"]["name"] for t in tools]
    if choice not in CHOICES and choice not in names:
        raise ToolCallError(f"tool_choice names the function {choice!r}, which is not among the tools "
                            f"({', '.join(names)})")
    return choice
