"""Full KV pages kept after their request ends, for the next request whose prompt starts with the
same tokens (vLLM's automatic prefix caching, SGLang's radix cache, reduced to a hash chain).

A page's key hashes the key of the page before it, the model and the page's tokens, so one key
names a whole prefix: a prompt hits its longest chain of cached pages from its first token on.
A cached page is shared read-only by every request that hits it (reference counts); writes only
ever go to a request's own pages after its hit. Pages no request holds stay cached until the pool
needs room, then are evicted oldest first: a running request never loses a page. A request may
ask that its pages outlast others for a while (retention, a soft priority as TensorRT-LLM's and
SGLang's): idle pages still retained go only when no other idle page is left, and that is counted.
With a lower tier (:mod:`icekv.kv.prefix_tier`), pages are also written below as they are cached,
and a chain that reaches a page the pool no longer holds reads it back from there. A listener
(``events``: :class:`PageEvents`) hears each page cached and each evicted, for the routers that
track where prefixes are (:mod:`icekv.serving.kv_events`).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np


def page_keys(model_id: str, ids: list[int], page_size: int) -> list[bytes]:
    """The chain of keys of the full pages of ``ids`` (a partial last page has none)."""
    keys, parent = [], model_id.encode()
    tokens = np.asarray(ids[: len(ids) // page_size * page_size], dtype=np.int64)  # [full pages * P]
    for page in tokens.reshape(-1, page_size):
        parent = hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PageEvents(Protocol):
    def stored(self, key: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        """The page of prefix ``key`` (its tokens ``token_ids``, following prefix ``parent``; None:
        the first page) is cached."""

    def removed(self, keys: list[bytes]) -> None:
        """The pages of these prefixes left the cache."""


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made (the server's metrics read them)."""

    hit_tokens: int = 0  # prompt tokens found cached, not prefilled
    miss_tokens: int = 0  # prompt tokens prefilled by requests that looked
    evictions: int = 0  # cached pages dropped for room
    retained_evictions: int = 0  # of them, pages dropped while their retention lasted (the pool was short)
    reloaded_pages: int = 0  # pages of a hit read back from the lower tier (evicted, or cached by another process)


class PrefixCache:
    """Which pool pages hold which prefixes, who holds them, and which may go (page ids only: the
    pool and its allocator belong to :class:`icekv.kv.PagedKVCache`)."""

    def __init__(self, model_id: str, page_size: int, clock: Callable[[], float] = time.monotonic):
        self.model_id, self.page_size, self.clock = model_id, page_size, clock
        self._page_of: dict[bytes, int] = {}  # key -> the page holding that prefix's last page
        self._key_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}  # cached page -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first
        self._retained: dict[int, float] = {}  # cached page -> the clock time its retention ends
        self.stats = PrefixCacheStats()
        self.lower = None  # a PrefixTier: pages written below as they are cached, read back on a miss
        self.events: PageEvents | None = None

    @property
    def pages(self) -> int:
        """Pages cached (held by requests or idle)."""
        return len(self._key_of)

    @property
    def evictable(self) -> int:
        """Cached pages no request holds: free for the pool's next allocation."""
        return len(self._idle)

    def match(self, ids: list[int], most_tokens: int) -> list[int]:
        """The pages of the longest cached prefix of ``ids`` within ``most_tokens`` tokens, now held
        by the caller (hand them back with :meth:`release`)."""
        pages = []
        keys = page_keys(self.model_id, ids[:most_tokens], self.page_size)
        for i, key in enumerate(keys):
            page = self._page_of.get(key)
            if page is None and self.lower is not None:
                page = self.lower.fetch(key)  # may evict idle pages for room: the ones held so far are not
                if page is not None:
                    self._page_of[key], self._key_of[page], self._refs[page] = page, key, 0
                    self.stats.reloaded_pages += 1
                    self._stored(keys, ids, i)
            if page is None:
                break
            self._refs[page] += 1
            self._idle.pop(page, None)
            pages.append(page)
        hit = len(pages) * self.page_size
        self.stats.hit_tokens += hit
        self.stats.miss_tokens += len(ids) - hit
        return pages

    def release(self, pages: list[int], retention_s: float = 0.0) -> None:
        """A request lets go of cached ``pages`` (a prefix's, in order), retaining them
        ``retention_s`` more seconds; the ones nobody holds now become evictable, the prefix's
        last page first (the tail of a chain goes before its head, which every longer prefix needs)."""
        self._retain(pages, retention_s)
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._idle[page] = None
                self._idle.move_to_end(page)

    def insert(self, ids: list[int], pages: list[int], first: int = 0, retention_s: float = 0.0) -> list[int]:
        """Cache a finished request's own full pages: ``pages[i]`` holds tokens ``ids[i*P :
        (i+1)*P]``, and ``pages[:first]`` are cached already (its hit), retained ``retention_s``
        seconds. Returns the pages not kept, to be freed: a partial last one, and duplicates of a
        prefix another request cached first (whose copy is retained instead)."""
        keys = page_keys(self.model_id, ids, self.page_size)
        dropped, cached = list(pages[max(len(keys), first):]), []
        for i, (key, page) in reversed(list(enumerate(zip(keys, pages)))[first:]):  # the tail evicted first
            if key in self._page_of:
                dropped.append(page)
                continue
            self._page_of[key], self._key_of[page], self._refs[page] = page, key, 0
            self._idle[page] = None
            self._keep_below(key, page)
            cached.append(i)
        for i in reversed(cached):  # heard in prefix order: each page's parent first
            self._stored(keys, ids, i)
        self._retain([self._page_of[key] for key in keys[first:]], retention_s)
        return dropped

    def _retain(self, pages: list[int], retention_s: float) -> None:
        if retention_s > 0:
            until = self.clock() + retention_s
            for page in pages:
                self._retained[page] = max(self._retained.get(page, until), until)

    def publish(self, ids: list[int], pages: list[int], first: int) -> int:
        """A running request's full pages ``pages[first:]`` (``pages[i]`` holds ``ids[i*P :
        (i+1)*P]``, final: never written again) become cached and held by it, so that requests
        starting now share them; up to the first prefix cached already. Returns how many of its
        pages it holds from the cache now."""
        keys = page_keys(self.model_id, ids, self.page_size)
        held = first
        for i, (key, page) in list(enumerate(zip(keys, pages)))[first:]:
            if key in self._page_of:
                break
            self._page_of[key], self._key_of[page], self._refs[page] = page, key, 1
            self._keep_below(key, page)
            self._stored(keys, ids, i)
            held += 1
        return held

    def _keep_below(self, key: bytes, page: int) -> None:
        if self.lower is not None:
            self.lower.keep(key, page)

    def _stored(self, keys: list[bytes], ids: list[int], i: int) -> None:
        """Page ``i`` of the chain ``keys`` (over ``ids``) is cached now: the listener hears it."""
        if self.events is not None:
            P = self.page_size
            self.events.stored(keys[i], keys[i - 1] if i else None, list(ids[i * P:(i + 1) * P]))

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def evict(self, n: int) -> list[int]:
        """Drop up to ``n`` idle pages, least recently used first, those still retained only when
        no other is left; returns them, to be freed."""
        now = self.clock()
        self._retained = {page: until for page, until in self._retained.items() if until > now}
        plain = list(islice((page for page in self._idle if page not in self._retained), n))
        out = plain + list(islice((page for page in self._idle if page in self._retained), n - len(plain)))
        keys = [self._key_of[page] for page in out]
        for page, key in zip(out, keys):
            del self._idle[page], self._page_of[key], self._key_of[page], self._refs[page]
            self._retained.pop(page, None)
        if self.events is not None and keys:
            self.events.removed(keys)
        self.stats.evictions += len(out)
        self.stats.retained_evictions += len(out) - len(plain)
        return out
