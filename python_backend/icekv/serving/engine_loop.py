"""The engine thread of the Triton model: steps the engine and routes results to Triton.

Scheduling itself (admission by memory, the waiting queue, the per-step token budget, continuous
batching) is the engine's (:mod:`icekv.engine.scheduler`); this thread only submits requests,
turns client hang-ups into cancellations and sends each request's text and result to its sink.

The engine is built on this thread, not on the caller's: torch and numba run their parallel loops
on OpenMP, and once a second thread has an OpenMP team of its own, libgomp counts more threads
than cores and stops spinning between parallel regions; every small matmul of a decode step then
waits for its workers to wake (measured: a decode step ~2.5x slower than on the loading thread).
So one thread does all of the engine's work, and Triton's threads only tokenize and queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from icekv.engine import BusyError, Cancelled, Engine, Generation, Sequence
from icekv.errors import IcekvError
from icekv.serving.request import GenerateRequest

log = logging.getLogger(__name__)

__all__ = ["BusyError", "EngineLoop", "SchedulerStats", "Sink"]


class Sink(Protocol):
    """Where a request's results go (a Triton response sender, a test list...)."""

    def cancelled(self) -> bool: ...

    def text(self, delta: str) -> None: ...

    def done(self, result: Generation) -> None: ...

    def error(self, message: str, kind: str) -> None:
        """kind: "client" (bad request), "busy" (retry later), "cancelled" or "internal" (our bug)."""


TICK_S = 0.25  # how often the engine thread runs on_tick (metrics updates)


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


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], on_tick: Callable[["EngineLoop"], None] | None = None,
                 tick_s: float = TICK_S):
        """Builds the engine with ``make_engine`` on the engine thread and waits until it is loaded
        (its errors are raised here). ``on_tick`` runs on the engine thread at most every ``tick_s``
        (metrics updates)."""
        self._on_tick, self._tick_s, self._last_tick = on_tick, tick_s, 0.0
        self.stats = SchedulerStats()
        self._sinks: dict[Sequence, Sink] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._loaded: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="icekv-engine", daemon=True)
        self._thread.start()
        engine = self._loaded.get()
        if isinstance(engine, BaseException):
            raise engine
        self.engine: Engine = engine

    # ---- called from Triton's threads
    def submit(self, request: GenerateRequest, sink: Sink, context=None) -> None:
        """Queue a validated request; raises IcekvError (client fault) or BusyError."""
        ids = self.engine.tokenizer.encode(request.text)  # outside the lock: the engine thread goes on
        with self._wake:  # the sink is known before the engine thread can step the request
            seq = self.engine.submit(ids, request.sampling, request.selection, context, sink.text)
            self._sinks[seq] = sink
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread
    def _run(self, make_engine: Callable[[], Engine]) -> None:
        try:
            self.engine = make_engine()
        except BaseException as e:
            self._loaded.put(e)
            return
        self._loaded.put(self.engine)
        self._loop()

    def _loop(self) -> None:
        while not self._stopping:
            with self._wake:
                if self.engine.scheduler.idle and not self._stopping:  # wake each tick, so the last
                    self._wake.wait(timeout=self._tick_s)  # request's counters reach the metrics
                sinks = list(self._sinks.items())
            for seq, sink in sinks:
                if sink.cancelled():
                    seq.cancel()
            try:
                finished = self.engine.step()
            except Exception:  # a bug outside any one request: fail what is running, keep serving
                log.exception("engine step failed")
                finished = self._fail_all()
            for seq in finished:
                self._deliver(seq)
            self._count()
            self._tick()
        for seq in list(self._sinks):
            seq.cancel()
        while not self.engine.scheduler.idle:
            for seq in self.engine.step():
                self._sinks.pop(seq).error("server shutting down", kind="busy")

    def _fail_all(self) -> list[Sequence]:
        """Cancel every request (a step with only cancellations runs no model); if even that
        fails, tell every client and forget the requests."""
        for seq in list(self._sinks):
            seq.cancel()
        try:
            return self.engine.step()
        except Exception:
            log.exception("engine step failed while cancelling")
            with self._wake:
                sinks, self._sinks = list(self._sinks.values()), {}
            for sink in sinks:
                sink.error("internal error: the engine failed", kind="internal")
            return []

    def _count(self) -> None:
        scheduler = self.engine.scheduler
        self.stats.active, self.stats.queued = len(scheduler.running), len(scheduler.waiting)
        self.stats.index_bytes_promised = sum(s.index_bytes for s in scheduler.running)

    def _tick(self) -> None:
        if self._on_tick and not self._stopping and time.monotonic() - self._last_tick >= self._tick_s:
            self._last_tick = time.monotonic()
            try:
                self._on_tick(self)
            except Exception:
                log.exception("metrics update failed")

    def _deliver(self, seq: Sequence) -> None:
        with self._wake:
            sink = self._sinks.pop(seq)
        error = seq.error
        if error is None:
            result: Generation = seq.result
            self.stats.completed += 1
            self.stats.generated_tokens += result.new_tokens
            self.stats.select_s += result.timings.get("select_s", 0.0)
            self.stats.pages_moved += result.kv.pages_moved
            sink.done(result)
        elif isinstance(error, Cancelled):
            self.stats.cancelled += 1
            sink.error("request cancelled", kind="cancelled")  # Triton needs a final response
        elif isinstance(error, IcekvError):
            self.stats.failed += 1
            sink.error(str(error), kind="client")
        else:  # a bug in one request must not take the others down
            log.error("request failed", exc_info=error)
            self.stats.failed += 1
            sink.error("internal error: the request failed (details in the server log)", kind="internal")
