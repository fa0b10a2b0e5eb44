"""Decoded compressed contexts held once per key and shared by the requests that use them.

A bounded LRU: past ``max_bytes`` the least recently used contexts that no request holds are
dropped; one in use is never dropped (the engine's admission bounds what is in use). A context
is read-only to the requests sharing it (the engine's context token source never writes it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from icekv.compress import CompressedContext


@dataclass
class _Entry:
    context: CompressedContext
    users: int = 0


class SharedContexts:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, key: str) -> CompressedContext | None:
        """The context under ``key``, now held by one more request; None when not in memory."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            entry.users += 1
            return entry.context

    def add(self, key: str, context: CompressedContext, users: int = 1) -> CompressedContext:
        """Keep ``context`` under ``key`` held by ``users`` requests; if another copy got there
        first, that one is held and returned instead."""
        with self._lock:
            entry = self._entries.setdefault(key, _Entry(context))
            self._entries.move_to_end(key)
            entry.users += users
            self._evict()
            return entry.context

    def release(self, key: str) -> None:
        """One request is done with ``key``'s context."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.users > 0:
                entry.users -= 1
                self._evict()

    def users(self, key: str) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.users if entry is not None else 0

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.context.nbytes for e in self._entries.values())

    def _evict(self) -> None:
        total = sum(e.context.nbytes for e in self._entries.values())
        for key in [k for k, e in self._entries.items() if e.users == 0]:  # oldest first
            if total <= self.max_bytes:
                return
            total -= self._entries.pop(key).context.nbytes
