"""Reusable contexts in serving: each compressed once, stored, and shared by every request naming it.

A request brings a context (text or token ids, with a method and a budget) or only its key. The
key is derived as ``icekv compress`` derives it, so CLI- and server-made entries are the same
entries. Lookups (memory, then the store) run on Triton's threads; a miss becomes a
:class:`CompressionJob` that the engine thread drives between its steps, and every request that
asks for the same key meanwhile waits on that one job.

Replicas sharing a store join each other's compressions too: a replica claims a key in the store
before it compresses (:meth:`ContextStore.claim`) and renews the claim while it works; another
replica asked for the same key meanwhile polls the store for the entry, and compresses the
context itself only if the claim is given up or lapses without one (the claimant failed, was
cancelled or died). A store that fails is no reason to refuse: the replica then compresses alone.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from icekv.compress import CompressedContext
from icekv.engine import BusyError, Cancelled
from icekv.engine.compression import CompressionJob
from icekv.errors import IcekvError
from icekv.serving.request import ContextRequest, RequestError
from icekv.serving.shared_contexts import SharedContexts
from icekv.store import CLAIM_TTL_S, StoreError, context_key

log = logging.getLogger(__name__)
STORE_POLL_S = 0.25  # how often a replica waiting on another's compression looks for its entry


@dataclass(frozen=True)
class ContextSpec:
    """A context to find or compress: its key and what makes it."""

    key: str
    ids: tuple[int, ...]
    method: str
    kv_budget: float
    settings: tuple[tuple[str, Any], ...] = ()  # the method's settings (the server's)


@dataclass
class ContextStats:
    hits: int = 0  # found in memory or in the store
    misses: int = 0  # compressions run
    joined: int = 0  # waited on a compression another request started (here or on another replica)
    compress_s: float = 0.0
    bytes_saved: int = 0  # full KV bytes minus compressed bytes, per compression


@dataclass
class _Job:
    job: CompressionJob
    spec: ContextSpec
    waiters: list[Any] = field(default_factory=list)  # opaque to this class: the loop's (request, sink)
    started: float = field(default_factory=time.perf_counter)
    renewed: float | None = None  # monotonic time of the store claim's last renewal (None: no claim held)


@dataclass
class _StoreWait:
    """Requests waiting for a context another replica claimed: its entry is looked for in the store."""

    spec: ContextSpec
    waiters: list[Any]
    next_poll: float = 0.0  # monotonic


class ContextService:
    def __init__(self, engine, store, max_bytes: int, max_compress_tokens: int, method_settings: dict | None = None,
                 claim_ttl_s: float = CLAIM_TTL_S):
        """method_settings: method -> the settings this server compresses with (default: none);
        claim_ttl_s: how long this replica's claim on a context it compresses outlives its last
        renewal (renewed every third of it)."""
        self.engine, self.store, self.max_compress_tokens = engine, store, max_compress_tokens
        self.method_settings = method_settings or {}
        self.claim_ttl_s = claim_ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # this replica, in claims
        self.shared = SharedContexts(max_bytes)
        self.stats = ContextStats()
        self._jobs: dict[str, _Job] = {}  # the engine thread's
        self._waits: dict[str, _StoreWait] = {}  # the engine thread's: contexts another replica compresses

    @classmethod
    def in_memory(cls, engine) -> "ContextService":
        """No store: contexts live in memory only, bounded as admission bounds contexts in use."""
        return cls(engine, None, engine.kv.context_limit, engine.cache.capacity_tokens)

    # ---- Triton's threads
    def lookup(self, request) -> tuple[str | None, CompressedContext | None, ContextSpec | None]:
        """Where a generate request's context is: ``(key, context, None)`` found (held for it),
        ``(None, None, spec)`` to compress first, all None without one; RequestError for a
        ``context_key`` neither memory nor the store has."""
        if request.context is not None:
            spec = self.spec(request.context, request.context_key)
            context = self.find(spec.key, can_compress=True)
            return (spec.key, context, None) if context is not None else (None, None, spec)
        if request.context_key is None:
            return None, None, None
        context = self.find(request.context_key)
        if context is None:
            raise RequestError(f"unknown context_key {request.context_key!r}: not in memory or the context store "
                               "(send the context itself, or store it with icekv compress)")
        return request.context_key, context, None

    def spec(self, request: ContextRequest, claimed_key: str | None) -> ContextSpec:
        """Tokenize and check a request's context; RequestError for anything wrong with it."""
        ids = list(request.ids) if request.ids is not None else self.engine.tokenizer.encode(request.text)
        if not ids:
            raise RequestError("context is empty")
        vocab = self.engine.model.args.vocab_size
        if request.ids is not None and not all(0 <= i < vocab for i in ids):
            raise RequestError(f"context_ids must be token ids in 0..{vocab - 1}")
        if len(ids) > self.max_compress_tokens:
            raise RequestError(f"context of {len(ids)} tokens exceeds this server's limit of {self.max_compress_tokens} "
                               "tokens (max_compress_tokens)")
        self.engine.check_fits(len(ids), 1)
        settings = self.method_settings.get(request.method, {})
        key = context_key(self.engine.model_id, ids, request.method, request.kv_budget, settings)
        if claimed_key is not None and claimed_key != key:
            raise RequestError(f"context_key {claimed_key!r} does not match the context sent (its key is {key}); "
                               "send one of them, or both agreeing")
        return ContextSpec(key, tuple(ids), request.method, request.kv_budget, tuple(sorted(settings.items())))

    def find(self, key: str, can_compress: bool = False) -> CompressedContext | None:
        """The context under ``key``, held for one request (release it with :meth:`release`), from
        memory or the store; None when neither has it. With ``can_compress`` (the request brought
        the context itself) an unusable entry or a failing store is a miss too: it is compressed
        again rather than refused."""
        context = self.find_in_memory(key)
        if context is not None:
            return context
        if self.store is not None:
            stored = self._from_store(key, can_compress)
            if stored is not None:
                self.stats.hits += 1
                return self.shared.add(key, stored)
        return None

    def _from_store(self, key: str, can_compress: bool) -> CompressedContext | None:
        """The stored entry under ``key``, or None; an unusable entry or a failing store is None
        too where the context can be compressed here, else a RequestError / BusyError."""
        try:
            return self.store.load(key)
        except StoreError as e:
            if not can_compress:
                raise RequestError(f"context_key {key!r}: {e}") from None
            log.warning("stored context refused, compressing it again: %s", e)
        except Exception as e:  # the store itself failed (unreachable Redis, disk error)
            log.error("context store lookup failed: %s", e)
            if not can_compress:
                raise BusyError("server busy: the context store is unavailable, retry later") from None
        return None

    def find_in_memory(self, key: str) -> CompressedContext | None:
        """:meth:`find` without the store (no I/O: the engine thread may call it)."""
        context = self.shared.acquire(key)
        if context is not None:
            self.stats.hits += 1
        return context

    def release(self, key: str) -> None:
        self.shared.release(key)

    # ---- the engine thread
    def attach(self, spec: ContextSpec, waiter) -> tuple[str, CompressedContext | None]:
        """Where ``waiter`` gets ``spec``'s context: ``("hit", context)`` when another request has
        just made it (held for the waiter); else attached to its compression, started now if none
        runs here and no other replica claims it: ``("compressed", None)`` or ``("joined", None)``.
        Raises IcekvError (bad settings, busy) when a new job cannot start."""
        context = self.find_in_memory(spec.key)
        if context is not None:
            return "hit", context
        running = self._jobs.get(spec.key) or self._waits.get(spec.key)
        if running is not None:
            running.waiters.append(waiter)
            self.stats.joined += 1
            return "joined", None
        if not self._claim_unstored(spec.key):  # another replica compresses it, or just did
            self._waits[spec.key] = _StoreWait(spec, [waiter])
            self.stats.joined += 1
            return "joined", None
        self._start(spec, [waiter])
        return "compressed", None

    def _start(self, spec: ContextSpec, waiters: list) -> None:
        """Compress ``spec``'s context for ``waiters`` (its claim taken); IcekvError when it cannot start."""
        try:
            job = CompressionJob(self.engine, list(spec.ids), spec.method, spec.kv_budget, **dict(spec.settings))
        except BaseException:
            self._release_claim(spec.key)
            raise
        renewed = time.monotonic() if self.store is not None else None
        self._jobs[spec.key] = _Job(job, spec, waiters, renewed=renewed)
        self.stats.misses += 1

    @property
    def busy(self) -> bool:
        """A compression runs here (waits on other replicas need only the loop's ticks)."""
        return bool(self._jobs)

    def advance(self) -> list[tuple[str, list, CompressedContext | None, BaseException | None]]:
        """One scoring slice of the oldest job that has one; then every finished job, and every
        wait whose context another replica stored, as (key, waiters, context held once per
        waiter, error). Waits are looked at no more often than the loop calls this (each engine
        step, or its idle tick)."""
        self._renew_claims()
        scoring = next((j for j in self._jobs.values() if j.job.scoring), None)
        if scoring is not None:
            scoring.job.advance()
        finished = []
        for key, entry in [(k, j) for k, j in self._jobs.items() if j.job.done]:
            del self._jobs[key]
            finished.append((key, entry.waiters, *self._finish(entry)))
        return finished + self._poll_waits()

    def _finish(self, entry: _Job) -> tuple[CompressedContext | None, BaseException | None]:
        job = entry.job
        try:
            if job.error is not None:
                if not isinstance(job.error, (IcekvError, Cancelled)):
                    log.error("compression failed", exc_info=job.error)
                return None, job.error
            context = job.result
            self.stats.compress_s += time.perf_counter() - entry.started
            self.stats.bytes_saved += max(context.full_bytes - context.nbytes, 0)
            if self.store is not None:
                try:
                    self.store.save(entry.spec.key, context)
                except Exception:  # served from memory; other replicas compress it again
                    log.exception("could not store compressed context %s", entry.spec.key)
            return self.shared.add(entry.spec.key, context, users=len(entry.waiters)), None
        finally:
            if entry.renewed is not None:
                self._release_claim(entry.spec.key)

    def _poll_waits(self) -> list[tuple[str, list, CompressedContext | None, BaseException | None]]:
        """Waits due a look: the entry found (done), or the claim given up or lapsed without one
        (compressed here now, the waiters moved to the job)."""
        finished, now = [], time.monotonic()
        for key, wait in [(k, w) for k, w in self._waits.items() if w.next_poll <= now]:
            wait.next_poll = now + STORE_POLL_S
            context = self._from_store(key, can_compress=True)
            if context is not None:
                del self._waits[key]
                finished.append((key, wait.waiters, self.shared.add(key, context, users=len(wait.waiters)), None))
            elif self._claim_unstored(key):
                del self._waits[key]
                try:
                    self._start(wait.spec, wait.waiters)
                except Exception as e:  # its waiters fail; nobody else is waiting on this loop's error
                    finished.append((key, wait.waiters, None, e))
        return finished

    def _renew_claims(self) -> None:
        """Renew this replica's claims every third of their lifetime; a claim lost meanwhile (this
        engine thread stalled past it) leaves the job running, unclaimed."""
        now = time.monotonic()
        for key, entry in self._jobs.items():
            if entry.renewed is not None and now - entry.renewed >= self.claim_ttl_s / 3:
                entry.renewed = now if self._claim(key) else None

    def _claim(self, key: str) -> bool:
        """Claim (or renew) ``key`` in the store; True without a store, or when the store fails (this
        replica then compresses on its own rather than wait on a store that cannot answer)."""
        if self.store is None:
            return True
        try:
            return self.store.claim(key, self.owner, self.claim_ttl_s)
        except Exception as e:
            log.error("context store claim failed, compressing without one: %s", e)
            return True

    def _release_claim(self, key: str) -> None:
        if self.store is not None:
            try:
                self.store.release(key, self.owner)
            except Exception as e:  # it lapses on its own
                log.error("context store claim release failed: %s", e)

    def _claim_unstored(self, key: str) -> bool:
        """Claim ``key`` to compress it, unless another replica holds the claim or has just stored
        the entry (its claim given back after saving); the store failing is no reason not to."""
        if not self._claim(key):
            return False
        try:
            stored = self.store is not None and self.store.has(key)
        except Exception as e:
            log.error("context store lookup failed: %s", e)
            return True
        if stored:
            self._release_claim(key)
        return not stored

    def drop_waiters(self, cancelled) -> list:
        """Remove waiters for which ``cancelled(waiter)`` holds; a job left without waiters is
        cancelled (its claim given back), a wait left without them dropped. Returns the removed
        waiters."""
        dropped = []
        for running in (self._jobs, self._waits):
            for key, entry in list(running.items()):
                gone = [w for w in entry.waiters if cancelled(w)]
                if gone:
                    entry.waiters = [w for w in entry.waiters if w not in gone]
                    dropped += gone
                if not entry.waiters:
                    del running[key]
                    if isinstance(entry, _Job):
                        self._cancel(entry)
        return dropped

    def cancel_all(self) -> list:
        """Stop every job and wait; their waiters."""
        waiters = [w for entry in (*self._jobs.values(), *self._waits.values()) for w in entry.waiters]
        for entry in self._jobs.values():
            self._cancel(entry)
        self._jobs.clear()
        self._waits.clear()
        return waiters

    def _cancel(self, entry: _Job) -> None:
        entry.job.cancel()
        if entry.renewed is not None:
            self._release_claim(entry.spec.key)
