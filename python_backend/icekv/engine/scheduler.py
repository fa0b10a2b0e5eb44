"""Which requests run in the next engine step: the waiting queue, admission and the token budget.

Requests wait in FIFO order until their worst case fits in what the running ones have not been
promised: KV pages for prompt + max_tokens, page-index host memory, compressed-context bytes and,
with the pool off the compute device, device memory: a request in prefill is charged its prefill
or its decode, whichever is more, one decoding only its decode
(:class:`icekv.config.SchedulerConfig`). Each step takes one decode token of every running
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

from icekv.config import SchedulerConfig
from icekv.engine.sequence import Cancelled, Sequence
from icekv.errors import IcekvError
from icekv.kv import PagedKVCache


class BusyError(IcekvError):
    """Too many requests are waiting; the client should retry later."""


class Scheduler:
    """Holds the waiting and running requests; :meth:`add` and ``Sequence.cancel`` may be called
    from any thread, :meth:`schedule` and :meth:`remove` from the one thread that steps."""

    def __init__(self, cfg: SchedulerConfig, cache: PagedKVCache, chunk_tokens: int, device_limit: int | None = None):
        self.cfg, self.cache, self.chunk_tokens = cfg, cache, chunk_tokens
        self.device_limit = device_limit  # None: device memory is not charged (the pool is on the device)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()
        pool_bytes = cache.capacity_tokens * cache.bytes_per_token
        self.index_limit = pool_bytes if cfg.max_index_bytes is None else cfg.max_index_bytes
        self.context_limit = pool_bytes if cfg.max_context_bytes is None else cfg.max_context_bytes

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (its worst case already set, its KV pages checked against the pool by
        ``Engine.check_fits``); IcekvError if its index or context could never fit, BusyError if
        the queue is full."""
        if seq.index_bytes > self.index_limit:
            raise IcekvError(
                f"policy {seq.selection.policy} needs a page index of ~{seq.index_bytes / 2**20:.0f} MiB for this "
                f"request, above max_index_bytes ({self.index_limit / 2**20:.0f} MiB): shorten the prompt "
                f"or max_tokens, or use a smaller index (icecache_r, quest) or none (streaming, full)")
        if seq.context_bytes > self.context_limit:
            raise IcekvError(f"the compressed context takes {seq.context_bytes / 2**20:.0f} MiB, above "
                             f"max_context_bytes ({self.context_limit / 2**20:.0f} MiB)")
        if self.device_limit is not None and seq.device_need.most > self.device_limit:
            raise IcekvError(
                f"this request needs ~{seq.device_need.most / 2**20:,.0f} MiB of device memory (its prefill keeps "
                f"every layer's K/V of the prompt there), above max_device_bytes ({self.device_limit / 2**20:,.0f} "
                f"MiB): shorten the prompt, or compress it as a context")
        with self._lock:
            if len(self.waiting) >= self.cfg.max_waiting:
                raise BusyError(f"server busy: {len(self.waiting)} requests already waiting, retry later")
            seq.queued_at = time.monotonic()
            self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, BaseException]]]:
        """This step's work [(sequence, tokens)], and the requests dropped before it with why."""
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
        return work, dropped

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
        while self.waiting and len(self.running) < self.cfg.max_running:
            seq = self.waiting[0]
            if not self._fits(seq):
                break  # the head of the queue goes first: no starvation
            self.running.append(self.waiting.popleft())

    def _fits(self, seq: Sequence) -> bool:
        promised = sum(self._pages_to_come(s) for s in self.running)
        index = sum(s.index_bytes for s in self.running) + seq.index_bytes
        contexts = {id(s.context): s.context_bytes for s in [*self.running, seq] if s.context is not None}
        context = sum(contexts.values())  # a context shared by several requests is held once
        return (promised + self._pages_to_come(seq) <= self.cache.allocator.num_free
                and index <= self.index_limit and context <= self.context_limit
                and (self.device_limit is None or self.device_promised() + seq.device_need.most <= self.device_limit))

    def device_promised(self) -> int:
        """Device bytes the running requests may hold: a prefill's prefill or decode, whichever is
        more, a decode's decode."""
        return sum(s.device_need.decode if s.decoding else s.device_need.most for s in self.running)

    def _pages_to_come(self, seq: Sequence) -> int:
        """Pages ``seq`` may still allocate: its worst case less what it holds."""
        return max(seq.pages - self.cache.pages_held(seq.seq_id), 0)
