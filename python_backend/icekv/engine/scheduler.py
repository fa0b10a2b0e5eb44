"""Which requests run in the next engine step: the waiting queue, admission and the token budget.

Requests wait in FIFO order until their worst case fits in what the running ones have not been
promised (:class:`icekv.engine.kv_manager.KVCacheManager` answers). Each step takes one decode token of every running
request first, then fills the rest of ``max_step_tokens`` with prompt chunks of the others, so a
long prompt never holds another request's next token for more than one step. Cancelled requests,
queued or running, are dropped at the start of the next step, and so is a request that has waited
longer than ``max_queue_wait_s`` (busy: a request that needs most of the pool may hold the head of
the queue, and whoever waits behind it is told to retry rather than left hanging).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from icekv.config.engine import SchedulerConfig
from icekv.engine.kv_manager import KVCacheManager
from icekv.engine.sequence import Cancelled, Sequence
from icekv.errors import IcekvError


class BusyError(IcekvError):
    """Too many requests are waiting; the client should retry later."""


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work: each request with the tokens it feeds (1 for a decode, a chunk of its
    prompt for a prefill), and the requests dropped before the step with why."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    dropped: list[tuple[Sequence, BaseException]] = field(default_factory=list)


class Scheduler:
    """Holds the waiting and running requests; :meth:`add` and ``Sequence.cancel`` may be called
    from any thread, :meth:`schedule` and :meth:`remove` from the one thread that steps. Whether a
    request fits is the KV-cache manager's answer (``kv.can_allocate``)."""

    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager, chunk_tokens: int):
        self.cfg, self.kv, self.chunk_tokens = cfg, kv, chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (charged its worst case at submit); BusyError if the queue is full."""
        with self._lock:
            if len(self.waiting) >= self.cfg.max_queued_requests:
                raise BusyError(f"server busy: {len(self.waiting)} requests already waiting, retry later")
            seq.queued_at = time.monotonic()
            self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> SchedulerOutput:
        """This step's work, and the requests dropped before it."""
        expired = time.monotonic() - self.cfg.max_queue_wait_s
        with self._lock:
            dropped = [(s, self._drop_reason(s, expired)) for s in self.waiting]
            dropped = [(s, why) for s, why in dropped if why is not None]
            gone = {id(s) for s, _ in dropped}
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
            self._admit()
        dropped += [(s, s.cancel_error or Cancelled("request cancelled")) for s in self.running if s.cancel_requested]
        self.running = [s for s in self.running if not s.cancel_requested]
        work = [(s, 1) for s in self.running if s.decoding]
        budget = self.cfg.max_step_tokens - len(work)
        for seq in self.running:
            if not seq.decoding and budget > 0:
                n = min(seq.remaining_prompt, self.chunk_tokens, budget)
                work.append((seq, n))
                budget -= n
        return SchedulerOutput(work, dropped)

    def _drop_reason(self, seq: Sequence, expired: float) -> BaseException | None:
        if seq.cancel_requested:
            return seq.cancel_error or Cancelled("request cancelled")
        if seq.queued_at < expired:
            return BusyError(f"server busy: waited {self.cfg.max_queue_wait_s:g} s in the queue without "
                             "enough free memory or a free slot (max_queue_wait_s), retry later")
        return None

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_active_requests:
            if not self.kv.can_allocate(self.waiting[0], self.running):
                break  # the head of the queue goes first: no starvation
            self.kv.allocate(self.waiting[0], self.running)
            self.running.append(self.waiting.popleft())
