"""JSON text from outside (a request's fields, a model's tool calls), read once by one rule: what
Python's ``json`` cannot hold, a number past its int-string limit or nesting past its recursion
limit, and a lone surrogate (a ``\\ud800`` escape, no text a tokenizer can read) are refused like
malformed JSON, with a message that names the problem."""

from __future__ import annotations

import json
from typing import Any, Callable


class JSONTextError(ValueError):
    """The text is not JSON icekv can use; the message says why."""


def _decoded(decode: Callable[[], Any]) -> Any:
    """``decode()``, its failures as JSONTextError."""
    try:
        return decode()
    except json.JSONDecodeError as e:
        raise JSONTextError(f"{e.msg} at character {e.pos}") from None
    except RecursionError:
        raise JSONTextError("it is nested too deep") from None
    except (ValueError, UnicodeDecodeError):  # the int-string limit; bytes that are not UTF-8
        raise JSONTextError("it holds a number of too many digits, or bytes that are not UTF-8") from None


def _usable(value: Any) -> Any:
    """``value``, once it holds no text a tokenizer cannot read (a lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise JSONTextError("it is not valid Unicode text (a lone surrogate)") from None
    return value


def read_json(text: str | bytes) -> Any:
    """``json.loads(text)``; JSONTextError where it is not JSON or not usable as such."""
    return _usable(_decoded(lambda: json.loads(text)))


def read_json_sequence(text: str, separators: str = "") -> list[Any]:
    """The JSON values ``text`` holds one after another, apart by whitespace and any of
    ``separators``, each read as :func:`read_json` reads one."""
    decoder, values, at = json.JSONDecoder(), [], 0
    gaps = " \t\r\n" + separators
    while True:
        while at < len(text) and text[at] in gaps:
            at += 1
        if at == len(text):
            return values
        value, at = _decoded(lambda: decoder.raw_decode(text, at))
        values.append(_usable(value))
