"""JSON text from outside (a request's fields, a model's tool calls), read once by one rule: what
Python's ``json`` cannot hold, a number past its int-string limit or nesting past its recursion
limit, and a lone surrogate (a ``\\ud800`` escape, no text a tokenizer can read) are refused like
malformed JSON, with a message that names the problem."""

from __future__ import annotations

import json
from typing import Any


class JSONTextError(ValueError):
    """The text is not JSON icekv can use; the message says why."""


def read_json(text: str | bytes) -> Any:
    """``json.loads(text)``; JSONTextError where it is not JSON or not usable as such."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise JSONTextError(f"{e.msg} at character {e.pos}") from None
    except RecursionError:
        raise JSONTextError("it is nested too deep") from None
    except (ValueError, UnicodeDecodeError):  # the int-string limit; bytes that are not UTF-8
        raise JSONTextError("it holds a number of too many digits, or bytes that are not UTF-8") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise JSONTextError("it is not valid Unicode text (a lone surrogate)") from None
    return value
