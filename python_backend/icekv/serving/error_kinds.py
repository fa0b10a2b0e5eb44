"""What kind of failure a request's error is, carried in its message.

Triton's gRPC stream delivers a decoupled model's error as text only (no status code), so the
kind travels as a fixed prefix of the message: the Triton model adds it, the OpenAI frontend
reads it back to choose the HTTP status. A message without a prefix is the client's fault,
except Triton's own report that the model's process does not answer (a stalled or restarting
Python stub), which is the server's.
"""

from __future__ import annotations

import re

PREFIXES = {"busy": "server busy", "cancelled": "request cancelled", "internal": "internal error"}
KINDS = ("client", *PREFIXES)
MODEL_PROCESS_DOWN = re.compile(r"Stub process '[^']*' is not healthy")  # Triton's Python backend's report


def tag(message: str, kind: str) -> str:
    """``message`` starting with ``kind``'s prefix (once)."""
    if kind not in KINDS:
        raise ValueError(f"unknown error kind {kind!r}")
    prefix = PREFIXES.get(kind, "")
    return message if message.startswith(prefix) else f"{prefix}: {message}"


def kind_of(message: str) -> str:
    """The kind :func:`tag` wrote into ``message``; "busy" for Triton's report that the model's
    process does not answer."""
    if MODEL_PROCESS_DOWN.search(message):
        return "busy"
    return next((kind for kind, prefix in PREFIXES.items() if message.startswith(prefix)), "client")
