"""A Sink for tests that drive the serving engine thread directly: it records what it is told."""

from __future__ import annotations

import threading


class RecordingSink:
    """One request's results; ``seen_active``: the most requests active while it streamed (with a loop)."""

    def __init__(self, loop=None, cancel: bool = False):
        self.loop, self.cancel = loop, cancel
        self.texts, self.result, self.failure, self.ready = [], None, None, None
        self.context_key = self.context_cache = ""
        self.seen_active = 0
        self.finished = threading.Event()

    def cancelled(self) -> bool:
        return self.cancel

    def text(self, delta: str) -> None:
        self.texts.append(delta)
        if self.loop is not None:
            self.seen_active = max(self.seen_active, len(self.loop.engine.scheduler.running))

    def done(self, result) -> None:
        self.result = result
        self.finished.set()

    def error(self, message: str, kind: str) -> None:
        self.failure = (kind, message)
        self.finished.set()

    def context_used(self, key: str, status: str) -> None:
        self.context_key, self.context_cache = key, status

    def context_ready(self, key: str, context) -> None:
        self.ready = context
        self.finished.set()
