"""What the engine loop exchanges with the serving code around it: the :class:`Sink` a request's
results go to, the counters it keeps for the metrics, and the error once its thread has ended."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from icekv.engine import BusyError, Cancelled, Generation
from icekv.errors import IcekvError


class Sink(Protocol):
    """Where a request's results go (a Triton response sender, a test list...)."""

    def cancelled(self) -> bool: ...

    def text(self, delta: str) -> None: ...

    def done(self, result: Generation) -> None: ...

    def error(self, message: str, kind: str) -> None:
        """kind: "client" (bad request), "busy" (retry later), "cancelled" or "internal" (our bug)."""

    def context_used(self, key: str, status: str) -> None:
        """The request runs over the context under ``key``: status hit | compressed | joined."""

    def context_ready(self, key: str, context) -> None:
        """The final answer of a request that only compressed its context."""


class EngineStopped(RuntimeError):
    """The engine thread has ended (stopped, or failed beyond recovery): no request can run."""




@dataclass
class SchedulerStats:
    active: int = 0
    queued: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    pages_moved: int = 0
    select_s: float = 0.0
    generated_tokens: int = 0
    index_bytes_promised: int = 0
    device_bytes_promised: int = 0


def error_reply(error: BaseException) -> tuple[str, str]:
    """The one mapping of a request's error to what its client is told: (message, kind), kind as
    :mod:`icekv.serving.error_kinds` carries it. An error that is no IcekvError is our bug: the
    client learns only that (the caller logs the rest)."""
    if isinstance(error, Cancelled):
        return "request cancelled", "cancelled"
    if isinstance(error, BusyError):
        return str(error), "busy"
    if isinstance(error, EngineStopped):
        return str(error), "internal"
    if isinstance(error, (IcekvError, json.JSONDecodeError)):
        return str(error), "client"
    return "internal error: the request failed (details in the server log)", "internal"
