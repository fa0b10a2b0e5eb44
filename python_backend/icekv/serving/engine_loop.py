"""The engine thread of the Triton model: steps the engine and routes results to Triton.

Scheduling itself (admission by memory, the waiting queue, the per-step token budget, continuous
batching) is the engine's (:mod:`icekv.engine.scheduler`); this thread only submits requests,
turns client hang-ups into cancellations and sends each request's text and result to its sink.

The engine is built on this thread, not on the caller's: torch and numba run their parallel loops
on OpenMP, and once a second thread has an OpenMP team of its own, libgomp counts more threads
than cores and stops spinning between parallel regions; every small matmul of a decode step then
waits for its workers to wake, and a decode step runs several times slower than on the loading
thread.
So one thread does all of the engine's work, and Triton's threads only tokenize and queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace
from typing import Callable

from icekv.engine import BusyError, Cancelled, Engine, Generation, Sequence
from icekv.errors import IcekvError
from icekv.serving.context_service import ContextService, ContextSpec
from icekv.serving.loop_api import EngineStopped, SchedulerStats, Sink, error_reply
from icekv.serving.request import GenerateRequest

log = logging.getLogger(__name__)

__all__ = ["EngineLoop", "EngineStopped", "Sink"]

TICK_S = 0.25  # how often the engine thread runs on_tick (metrics updates)


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], on_tick: Callable[["EngineLoop"], None] | None = None,
                 tick_s: float = TICK_S, make_contexts: Callable[[Engine], ContextService] | None = None):
        """Builds the engine with ``make_engine`` on the engine thread and waits until it is loaded
        (its errors are raised here), then its context service with ``make_contexts`` (default: no
        store, contexts bounded by the scheduler's context bytes). ``on_tick`` runs on the engine
        thread at most every ``tick_s`` (metrics updates)."""
        self._on_tick, self._tick_s, self._last_tick = on_tick, tick_s, 0.0
        self.stats = SchedulerStats()
        self._sinks: dict[Sequence, Sink] = {}
        self._context_of: dict[Sequence, str] = {}  # requests holding a shared context: its key
        self._to_compress: list[tuple[GenerateRequest, Sink, ContextSpec]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self.alive = True  # False once the engine thread has ended: every request is refused
        self._loaded: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, args=(make_engine, make_contexts), name="icekv-engine",
                                        daemon=True)
        self._thread.start()
        engine = self._loaded.get()
        if isinstance(engine, BaseException):
            raise engine
        self.engine: Engine = engine

    # ---- called from Triton's threads
    def submit(self, request: GenerateRequest, sink: Sink, context=None, context_key: str | None = None) -> None:
        """Queue a validated request; raises IcekvError (client fault) or BusyError. With
        ``context_key``, ``context`` is held for this request in the context service, which gets
        it back when the request ends (or now, if it is refused)."""
        try:
            ids = request.prompt_ids  # tokenized by the caller's thread, not the engine's
            if ids is None:
                ids = self.engine.tokenizer.encode(request.text)  # outside the lock: the engine thread goes on
            with self._wake:  # the sink is known before the engine thread can step the request
                self.check_alive()
                seq = self.engine.submit(ids, request.sampling, request.plan, context, sink.text,
                                         caching=request.caching)
                self._sinks[seq] = sink
                if context_key is not None:
                    self._context_of[seq] = context_key
                self._wake.notify()
        except BaseException:
            if context_key is not None:
                self.contexts.release(context_key)
            raise

    def serve(self, request: GenerateRequest, sink: Sink) -> None:
        """Run ``request`` over its context (found in memory or the store, or compressed first) or
        over none; a compress-only request is answered once its context is ready."""
        key, context, to_compress = self.contexts.lookup(request)
        if to_compress is not None:
            if request.text is not None:  # refuse now what would fail after the compression
                request = replace(request, prompt_ids=self.engine.tokenizer.encode(request.text))
                self.engine.check_request(len(request.prompt_ids), request.sampling.max_tokens, request.plan,
                                          context_tokens=len(to_compress.ids))
            return self.submit_compression(request, sink, to_compress)
        if key is None:
            return self.submit(request, sink)
        sink.context_used(key, "hit")
        if request.text is None:  # only compress: it is already
            self.contexts.release(key)
            return sink.context_ready(key, context)
        self.submit(request, sink, context, key)

    def submit_compression(self, request: GenerateRequest, sink: Sink, spec: ContextSpec) -> None:
        """Queue a request whose context is not compressed yet: the engine thread compresses it (or
        joins the compression already running for its key), then runs the request over it."""
        with self._wake:
            self.check_alive()
            self._to_compress.append((request, sink, spec))
            self._wake.notify()

    def check_accepting(self) -> None:
        """Refuse early, before a request is parsed: EngineStopped, or BusyError when the queue is
        already full (the scheduler checks again when the request is queued)."""
        self.check_alive()
        scheduler = self.engine.scheduler
        if len(scheduler.waiting) + len(self._to_compress) >= scheduler.cfg.max_queued_requests:
            raise BusyError(f"server busy: {len(scheduler.waiting)} requests already waiting, retry later")

    def check_alive(self) -> None:
        """EngineStopped once the engine thread has ended."""
        if not self.alive:
            raise EngineStopped("internal error: the engine stopped; the server must be restarted")

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread
    def _run(self, make_engine: Callable[[], Engine], make_contexts) -> None:
        try:
            self.engine = make_engine()
            self.contexts = (make_contexts or ContextService.in_memory)(self.engine)
        except BaseException as e:
            self._loaded.put(e)
            return
        self._loaded.put(self.engine)
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception:  # a bug in the loop's own handling: fail what is in flight, serve on
                    log.exception("serving loop failed: failing the requests in flight")
                    for seq in self._fail_all():
                        self._deliver(seq)
            self._drain()
        except Exception:  # even failing the requests failed
            log.exception("the serving loop cannot recover: the engine is stopped")
        finally:  # nothing may wait forever
            self._die()

    def _iterate(self) -> None:
        with self._wake:
            idle = self.engine.scheduler.idle and not self.contexts.busy and not self._to_compress
            if idle and not self._stopping:  # wake each tick, so the last
                self._wake.wait(timeout=self._tick_s)  # request's counters reach the metrics
            sinks = list(self._sinks.items())
            to_compress, self._to_compress = self._to_compress, []
        for seq, sink in sinks:
            if sink.cancelled():
                seq.cancel()
        for request, sink in self.contexts.drop_waiters(lambda waiter: waiter[1].cancelled()):
            self._fail(sink, Cancelled("request cancelled"))
        for request, sink, spec in to_compress:
            self._compress(request, sink, spec)
        try:
            finished = self.engine.step()
            compressed = self.contexts.advance()
        except Exception:  # a bug outside any one request: fail what is running, keep serving
            log.exception("engine step failed")
            finished, compressed = self._fail_all(), []
        for seq in finished:
            self._deliver(seq)
        for key, waiters, context, error in compressed:
            self._start_waiters(key, waiters, context, error)
        self._count()
        self._tick()

    def _drain(self) -> None:
        """Shutting down: cancel everything and step until the engine holds nothing."""
        for request, sink in self.contexts.cancel_all():
            sink.error("server shutting down", kind="busy")
        for seq in list(self._sinks):
            seq.cancel()
        while not self.engine.scheduler.idle:
            for seq in self.engine.step():
                if seq in self._sinks:
                    self._sinks.pop(seq).error("server shutting down", kind="busy")

    def _die(self) -> None:
        """The loop has ended: refuse new requests and fail whatever is still waiting on it."""
        with self._wake:
            self.alive = False
            sinks, self._sinks = list(self._sinks.values()), {}
            queued, self._to_compress = self._to_compress, []
        sinks += [sink for _, sink, _ in queued]
        try:
            sinks += [sink for _, sink in self.contexts.cancel_all()]
        except Exception:
            log.exception("could not cancel the running compressions")
        for sink in sinks:
            try:
                sink.error("internal error: the engine stopped", kind="internal")
            except Exception:
                log.exception("could not tell a client that the engine stopped")

    def _compress(self, request: GenerateRequest, sink: Sink, spec: ContextSpec) -> None:
        """Run ``request`` over ``spec``'s context once it is ready (now, if another request has
        just made it)."""
        try:
            status, context = self.contexts.attach(spec, (request, sink))
        except Exception as e:  # this request fails (a bug is logged as internal); the others go on
            self._fail(sink, e)
            return
        sink.context_used(spec.key, status)
        if context is not None:
            self._start_waiters(spec.key, [(request, sink)], context, None)

    def _start_waiters(self, key: str, waiters: list, context, error) -> None:
        """Run each waiting request over its finished context (held once per waiter), or fail it."""
        for request, sink in waiters:
            if error is not None:
                self._fail(sink, error)
                continue
            if request.text is None:
                self.contexts.release(key)
                self.stats.completed += 1
                sink.context_ready(key, context)
                continue
            try:
                self.submit(request, sink, context, key)
            except IcekvError as e:  # the hold was given back by submit
                self._fail(sink, e)

    def _fail_all(self) -> list[Sequence]:
        """Cancel every request (a step with only cancellations runs no model); if even that
        fails, tell every client and forget the requests."""
        for request, sink in self.contexts.cancel_all():
            sink.error("internal error: the engine failed", kind="internal")
        for seq in list(self._sinks):
            seq.cancel(RuntimeError("the engine failed while serving this request"))
        try:
            return self.engine.step()
        except Exception:
            log.exception("engine step failed while cancelling")
            with self._wake:
                sinks, self._sinks = list(self._sinks.values()), {}
                held, self._context_of = list(self._context_of.values()), {}
            for key in held:
                self.contexts.release(key)
            for sink in sinks:
                sink.error("internal error: the engine failed", kind="internal")
            return []

    def _count(self) -> None:
        scheduler = self.engine.scheduler
        self.stats.active, self.stats.queued = len(scheduler.running), len(scheduler.waiting)
        self.stats.index_bytes_promised = self.engine.kv.index_promised(scheduler.running)
        self.stats.device_bytes_promised = self.engine.kv.device_promised(scheduler.running)

    def _tick(self) -> None:
        if self._on_tick and not self._stopping and time.monotonic() - self._last_tick >= self._tick_s:
            self._last_tick = time.monotonic()
            try:
                self._on_tick(self)
            except Exception:
                log.exception("metrics update failed")

    def _deliver(self, seq: Sequence) -> None:
        with self._wake:
            sink = self._sinks.pop(seq, None)
            key = self._context_of.pop(seq, None)
        if key is not None:
            self.contexts.release(key)
        if sink is None:
            return  # a compression's prefill: its job takes the result
        if seq.error is None:
            result: Generation = seq.result
            self.stats.completed += 1
            self.stats.generated_tokens += result.new_tokens
            self.stats.select_s += result.timings.get("select_s", 0.0)
            self.stats.pages_moved += result.kv.pages_moved
            sink.done(result)
        else:
            self._fail(sink, seq.error)

    def _fail(self, sink: Sink, error: BaseException) -> None:
        """Tell the client why its request ended without a result (Triton needs a final response)."""
        message, kind = error_reply(error)
        if kind == "cancelled":
            self.stats.cancelled += 1
        else:
            self.stats.failed += 1
        if kind == "internal":  # a bug in one request must not take the others down
            log.error("request failed", exc_info=error)
        sink.error(message, kind=kind)
