"""Interleave requests on one engine: admission by memory, then one step each, round robin.

Every admitted request is an engine step generator (prefill chunk or decode token per step), so
a long prefill never blocks the other streams for more than one chunk. A request is admitted
only when its worst case (prompt + max_tokens) fits in the pages not yet promised to others, and
its page index (host memory an IceCache or Quest request builds next to its KV: ~0.7x the KV of
the indexed layers for IceCache) fits in ``max_index_bytes`` not yet promised; otherwise it waits
in a bounded queue, and a full queue answers 'busy'. A request that could never fit is refused
up front. Cancelled requests are closed, which returns their pages and index.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field
import time
from typing import Callable, Protocol

from icekv.config import ServingConfig
from icekv.engine import Engine, Generation
from icekv.errors import IcekvError
from icekv.serving.request import GenerateRequest
from icekv.sizing import index_bytes

log = logging.getLogger(__name__)


class BusyError(IcekvError):
    """Too many requests are waiting; the client should retry later."""


class Sink(Protocol):
    """Where a request's results go (a Triton response sender, a test list...)."""

    def cancelled(self) -> bool: ...

    def text(self, delta: str) -> None: ...

    def done(self, result: Generation) -> None: ...

    def error(self, message: str, kind: str) -> None:
        """kind: "client" (bad request), "busy" (retry later), "cancelled" or "internal" (our bug)."""


TICK_S = 0.25  # how often the engine thread runs on_tick (metrics updates)


@dataclass
class Job:
    request: GenerateRequest
    prompt_ids: list[int]
    sink: Sink
    pages: int  # worst-case pages promised to this request
    index_bytes: int  # worst-case host bytes of its page index (estimate: icekv.sizing)
    context: object = None  # a CompressedContext the prompt continues
    steps: object = field(default=None)


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
    store_hits: int = 0
    index_bytes_promised: int = 0


class Scheduler:
    def __init__(self, engine: Engine, cfg: ServingConfig, on_tick: Callable[[], None] | None = None,
                 tick_s: float = TICK_S):
        """``on_tick`` runs on the engine thread at most every ``tick_s`` (metrics updates)."""
        self.engine, self.cfg = engine, cfg
        self._on_tick, self._tick_s, self._last_tick = on_tick, tick_s, 0.0
        self.stats = SchedulerStats()
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="icekv-scheduler", daemon=True)
        self._thread.start()

    # ---- called from Triton's threads
    def submit(self, request: GenerateRequest, sink: Sink, context=None) -> None:
        """Queue a validated request; raises IcekvError (client fault) or BusyError."""
        ids = self.engine.tokenizer.encode(request.text)
        self.engine.check_fits(len(ids), request.sampling.max_tokens)
        pages = math.ceil((len(ids) + request.sampling.max_tokens) / self.engine.cache.page_size)
        index = self._index_bytes(request, len(ids), context)
        if index > self.index_limit:
            raise IcekvError(
                f"policy {request.selection.policy} needs a page index of ~{index / 2**20:.0f} MiB for this "
                f"request, above max_index_bytes ({self.index_limit / 2**20:.0f} MiB): shorten the prompt "
                f"or max_tokens, or use a smaller index (icecache_r, quest) or none (streaming, full)")
        with self._wake:
            if len(self._queue) >= self.cfg.max_queued_requests:
                raise BusyError(f"server busy: {len(self._queue)} requests already waiting, retry later")
            self._queue.append(Job(request, ids, sink, pages, index, context))
            self.stats.queued = len(self._queue)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    @property
    def index_limit(self) -> int:
        """Host bytes the admitted requests' page indexes may take together."""
        if self.cfg.max_index_bytes is not None:
            return self.cfg.max_index_bytes
        return self.engine.cache.capacity_tokens * self.engine.cache.bytes_per_token

    def _index_bytes(self, request: GenerateRequest, prompt_tokens: int, context) -> int:
        """Worst-case index of a request: every token it may hold (a compressed context's kept ones too)."""
        tokens = prompt_tokens + request.sampling.max_tokens
        if context is not None:
            tokens += math.ceil(context.kv_budget * context.length)
        return index_bytes(self.engine.model.args, tokens, request.selection)

    # ---- the engine thread
    def _admit(self) -> None:
        with self._wake:
            while self._queue and len(self._active) < self.cfg.max_active_requests:
                job = self._queue[0]
                pages = sum(j.pages for j in self._active) + job.pages
                index = sum(j.index_bytes for j in self._active) + job.index_bytes
                if pages > self.engine.cache.allocator.num_pages or index > self.index_limit:
                    break  # wait for memory: the head of the queue goes first (no starvation)
                self._queue.popleft()
                r = job.request
                job.steps = self.engine.stream(job.prompt_ids, r.sampling, r.selection, context=job.context)
                self._active.append(job)
            self._count_active()
            self.stats.queued = len(self._queue)
            if not self._active and not self._stopping:  # idle: wake each tick, so the last
                self._wake.wait(timeout=self._tick_s)  # request's counters reach the metrics within one

    def _loop(self) -> None:
        while not self._stopping:
            self._admit()
            for job in list(self._active):
                self._step(job)
            if self._on_tick and not self._stopping and time.monotonic() - self._last_tick >= self._tick_s:
                self._last_tick = time.monotonic()
                try:
                    self._on_tick()
                except Exception:
                    log.exception("metrics update failed")
        for job in self._active + list(self._queue):
            if job.steps is not None:
                job.steps.close()
            job.sink.error("server shutting down", kind="busy")

    def _finish(self, job: Job) -> None:
        self._active.remove(job)
        self._count_active()

    def _count_active(self) -> None:
        self.stats.active = len(self._active)
        self.stats.index_bytes_promised = sum(j.index_bytes for j in self._active)

    def _step(self, job: Job) -> None:
        try:
            if job.sink.cancelled():
                job.steps.close()  # frees the request's pages
                self.stats.cancelled += 1
                self._finish(job)
                job.sink.error("request cancelled", kind="cancelled")  # Triton needs a final response
                return
            delta = next(job.steps)
            if delta:
                job.sink.text(delta)
        except StopIteration as done:
            result: Generation = done.value
            self.stats.completed += 1
            self.stats.generated_tokens += result.new_tokens
            self.stats.select_s += result.timings.get("select_s", 0.0)
            self.stats.pages_moved += result.kv.pages_moved
            self._finish(job)
            job.sink.done(result)
        except IcekvError as e:
            self.stats.failed += 1
            self._finish(job)
            job.sink.error(str(e), kind="client")
        except Exception as e:  # a bug must not take the other requests down
            log.exception("request failed")
            self.stats.failed += 1
            job.steps.close()
            self._finish(job)
            job.sink.error(f"internal error: {type(e).__name__}: {e}", kind="internal")
