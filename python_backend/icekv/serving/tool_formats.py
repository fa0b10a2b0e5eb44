"""The tool-call formats of the model families: how a model writes its calls, how they are read
back, and the grammar that makes a model call.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
  text (Qwen2.5 / Qwen3, Hermes, and the many templates that copy them): :mod:`icekv.serving.tool_calls`.
- ``llama3``: the whole output is one call object ``{"name": ..., "parameters": {...}}`` (several
  joined by ``;``), after ``<|python_tag|>`` where the model writes one (Llama 3.1-3.3's JSON tool
  calling).
- ``mistral``: the whole output is ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}``
  objects (Mistral 7B v0.3, Nemo, Small).

The format is read off the model's chat template (:func:`detect`), or set (the ``tool_format``
setting). A format's delimiters are written in a grammar as the tokenizer's own token where its
vocabulary has them as one token, and as plain text otherwise. Decoding skips special tokens, so
Llama's and Mistral's markers, special in their tokenizers, never reach the text: their outputs are
read with or without them. Hermes' tags must reach it: a format's ``markup`` is kept in the text
where the tokenizer makes it special (Hermes 3; Qwen's tags are plain tokens).

vLLM's and SGLang's parsers do this inside their engines, on their own request and tokenizer types;
none ships as a library on its own, so the reading here is icekv's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Collection

from icekv.engine.grammar import COMPACT
from icekv.json_text import JSONTextError, read_json, read_json_sequence
from icekv.serving.tool_calls import CLOSE, OPEN, ToolCall, ToolCallError, ToolCallStream, read_call

TokenId = Callable[[str], "int | None"]  # a text's id where the vocabulary has it as one token


def _token(text: str, token_id: TokenId) -> str:
    """``text`` in a Lark grammar: the tokenizer's own token (llguidance's ``<[id]>``), or the literal."""
    found = token_id(text)
    return f"<[{found}]>" if found is not None else json.dumps(text)


def _schemas(functions: list[dict], arguments_key: str) -> list[dict]:
    """One JSON schema per function: its name, and its parameters under ``arguments_key``."""
    return [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
             "properties": {"name": {"const": f["name"]}, arguments_key: f.get("parameters") or {"type": "object"}}}
            for f in functions]


def _json_rule(functions: list[dict], arguments_key: str) -> str:
    return "%json " + json.dumps({"x-guidance": COMPACT, "anyOf": _schemas(functions, arguments_key)})


class WholeOutputStream:
    """Streamed text of a format whose calls are the whole output: text that begins like a call
    (a marker, or the call's opening bracket) is held to the end and read then. A reading that
    fails, or that calls a function not among ``names`` (an answer that is JSON of its own), leaves
    it content, whole. Any other text passes at once."""

    def __init__(self, tool_format: "WholeOutput", names: Collection[str]):
        self._format, self._names, self._held, self._deciding = tool_format, set(names), "", True
        self.calls = 0

    def feed(self, piece: str) -> list[str | ToolCall]:
        if not self._deciding:
            return [piece] if piece else []
        self._held += piece
        start = self._held.lstrip()
        if not start or any(p.startswith(start) or start.startswith(p) for p in self._format.starts):
            return []
        self._deciding = False
        return [self._take()]

    def finish(self) -> list[str | ToolCall]:
        if not self._held:
            return []
        try:
            calls = self._format.read(self._held)
        except ToolCallError:
            return [self._take()]
        if any(call.name not in self._names for call in calls):
            return [self._take()]
        self._held, self.calls = "", len(calls)
        return list(calls)

    def _take(self) -> str:
        text, self._held = self._held, ""
        return text


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format (``name``) and what its template shows to find it."""

    name: str
    template_signs: tuple[str, ...]  # any of these in a chat template means this format

    @property
    def markup(self) -> tuple[str, ...]:
        """Delimiters its reading needs in the text, even where the tokenizer makes them special
        tokens (which decoding otherwise drops)."""
        return ()

    def stream(self, names: Collection[str]):
        """A stream that splits streamed text into content and calls (``names``: the offered functions)."""
        raise NotImplementedError

    def read(self, text: str) -> list[ToolCall]:
        """A whole output's calls; ToolCallError saying what is wrong with a malformed one."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], choice: str, parallel: bool, token_id: TokenId) -> str:
        """The Lark grammar (llguidance's dialect) of the output ``choice`` forces: one call (or,
        ``parallel``, one or more) to any of ``tools`` (``required``), or one call to the function
        ``choice`` names (as vLLM forces a named function: a small model offered more repeats the
        call until its token limit), each call's arguments held to that function's ``parameters``
        schema."""
        chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
        return self.calls_grammar(chosen, parallel and choice == "required", token_id)

    def calls_grammar(self, functions: list[dict], parallel: bool, token_id: TokenId) -> str:
        raise NotImplementedError


class Hermes(ToolFormat):
    @property
    def markup(self):
        return OPEN, CLOSE  # the calls are found by their tags (special tokens in Hermes 3's tokenizer)

    def stream(self, names):
        return ToolCallStream(names)

    def read(self, text):
        _, calls = split_calls(text, (), self)
        if not calls:
            raise ToolCallError(f"no {OPEN} block holds a call")
        return calls

    def calls_grammar(self, functions, parallel, token_id):
        more = ' ("\\n" call)*' if parallel else ""
        return (f'start: call{more}\ncall: {_token(OPEN, token_id)} "\\n" body "\\n" {_token(CLOSE, token_id)}\n'
                f"body: {_json_rule(functions, 'arguments')}\n")


class WholeOutput(ToolFormat):
    """A format whose output is nothing but its calls, after an optional ``marker``."""

    marker: str = ""
    opening: str = ""  # what the calls' JSON begins with

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.marker, self.opening)

    def stream(self, names):
        return WholeOutputStream(self, names)

    def read(self, text):
        body = text.strip().removeprefix(self.marker).strip()
        if not body.startswith(self.opening):
            raise ToolCallError(f"a {self.name} call begins with {self.opening!r}, got {body[:20]!r}")
        return self.calls(body)

    def calls(self, body: str) -> list[ToolCall]:
        raise NotImplementedError


class Llama3(WholeOutput):
    marker, opening = "<|python_tag|>", "{"

    def calls(self, body):
        try:
            values = read_json_sequence(body, ";")
        except JSONTextError as e:
            raise ToolCallError(f"the calls are not JSON objects apart by ';' ({e})") from None
        return [read_call(v) for v in values]

    def calls_grammar(self, functions, parallel, token_id):
        more = ' (";" call)*' if parallel else ""
        return f"start: call{more}\ncall: {_json_rule(functions, 'parameters')}\n"


class Mistral(WholeOutput):
    marker, opening = "[TOOL_CALLS]", "["

    def calls(self, body):
        try:
            value = read_json(body)
        except JSONTextError as e:
            raise ToolCallError(f"the calls are not a JSON list ({e})") from None
        if not isinstance(value, list) or not value:
            raise ToolCallError("the calls must be a non-empty JSON list of call objects")
        return [read_call(v) for v in value]

    def calls_grammar(self, functions, parallel, token_id):
        calls = 'call ("," call)*' if parallel else "call"
        return (f'start: {_token(self.marker, token_id)}? "[" {calls} "]"\n'
                f"call: {_json_rule(functions, 'arguments')}\n")


HERMES = Hermes("hermes", (OPEN,))
LLAMA3 = Llama3("llama3", ("<|python_tag|>", '"parameters": dictionary of argument name'))
MISTRAL = Mistral("mistral", ("[TOOL_CALLS]",))
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}  # the tool_format setting's values, but auto


def no_tokens(text: str) -> None:
    """The lookup of a vocabulary without delimiter tokens: every delimiter is written as text."""
    return None


@dataclass(frozen=True)
class ModelToolCalls:
    """A served model's tool calls: its format, and its vocabulary's lookup for the format's delimiters."""

    format: ToolFormat = HERMES
    token_id: TokenId = no_tokens

    def grammar(self, tools: list[dict], choice: str, parallel: bool) -> str:
        """:meth:`ToolFormat.grammar` for this model."""
        return self.format.grammar(tools, choice, parallel, self.token_id)


def split_calls(text: str, names: Collection[str] = (), tool_format: ToolFormat = HERMES
                ) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it is only calls) and its calls, in ``tool_format``."""
    stream = tool_format.stream(names)
    parts = stream.feed(text) + stream.finish()
    calls = [p for p in parts if isinstance(p, ToolCall)]
    content = "".join(p for p in parts if isinstance(p, str))
    return (content.strip() or None) if calls else content, calls


def detect(template: str | None) -> ToolFormat:
    """The format a chat template teaches its model (hermes when it shows none of the others')."""
    for candidate in (MISTRAL, LLAMA3, HERMES):
        if template and any(sign in template for sign in candidate.template_signs):
            return candidate
    return HERMES


def tool_format(setting: str, template: str | None) -> ToolFormat:
    """The format the ``tool_format`` setting names, or (``auto``) the one ``template`` teaches."""
    return detect(template) if setting == "auto" else FORMATS[setting]
