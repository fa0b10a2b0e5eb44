"""The prefix cache's lower tier in the context store: one entry per cached KV page, so that a
conversation's pages outlive their eviction from the pool and a restart, and replicas over one
store share them (as LMCache's and SGLang HiCache's lower tiers do).

An entry holds one page's rows of every layer ([L, 2, Hkv, P, W], as the pool stores them, so a
quantized pool stores its codes and scales) under a key derived from the page's hash chain (which
names the model, the KV format and every token before the page). It is signed and verified as
compressed contexts are (:mod:`icekv.store.format`): a corrupt, foreign or forged entry is never
loaded. Writes run on a background thread, off the engine's steps; reads are synchronous (a hit
waits for its pages).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors.torch import save

from icekv.kv.prefix_tier import PrefixTier
from icekv.store.format import CorruptEntry, StoreError, StoreUnavailable, digest, digest_scheme, verified

log = logging.getLogger(__name__)
FORMAT = "icekv-prefix-page"
VERSION = "1"
MAX_PENDING = 1024  # pages waiting to be written; past it a page is not written (counted)


def page_key(chain: bytes) -> str:
    """The store key of the page whose prefix cache key is ``chain`` (a sha256 hex digest)."""
    return hashlib.sha256(b"icekv-prefix-page:" + chain).hexdigest()


def encode_page(rows: torch.Tensor, key: str, model_id: str, secret: bytes | None = None) -> bytes:
    tensors = {"rows": rows.contiguous()}
    meta = {"format": FORMAT, "version": VERSION, "key": key, "model_id": model_id,
            "digest_scheme": digest_scheme(secret)}
    meta["digest"] = digest(meta, tensors, secret)
    return save(tensors, metadata=meta)


def decode_page(blob: bytes, key: str, model_id: str, shape: tuple, dtype: torch.dtype,
                secret: bytes | None = None) -> torch.Tensor:
    """The page's rows, verified; StoreError (CorruptEntry: unreadable or failing its digest)."""
    rows = verified(blob, key, model_id, FORMAT, VERSION, secret, "prefix")[1].get("rows")
    if rows is None:  # a digest-right entry icekv did not write (an unkeyed store's sha256 anyone can make)
        raise StoreError(f"entry {key[:12]}... holds no rows")
    if tuple(rows.shape) != tuple(shape) or rows.dtype != dtype:
        raise StoreError(f"entry {key[:12]}... has rows {tuple(rows.shape)} {rows.dtype}, this pool "
                         f"{tuple(shape)} {dtype}")
    return rows


@dataclass
class PrefixPageStats:
    written: int = 0  # pages written to the store
    loaded: int = 0  # pages read back into the pool
    refused: int = 0  # entries not used: corrupt (then deleted), foreign or of another shape
    failed: int = 0  # writes or reads the store failed (unreachable, full), or writes skipped (too many pending)


class PrefixPageStore:
    """Pages of one pool (rows ``shape`` of ``dtype``) in a byte store (:mod:`icekv.store.backends`)."""

    def __init__(self, backend, model_id: str, shape: tuple, dtype: torch.dtype, secret: bytes | None = None,
                 wait_when_full: bool = False):
        """``wait_when_full``: a page saved while MAX_PENDING pages wait to be written waits for
        room (every page is written: an evaluation's contexts); otherwise it is skipped (a
        server's step never waits)."""
        self.backend, self.model_id, self.shape, self.dtype, self.secret = backend, model_id, shape, dtype, secret
        self.stats = PrefixPageStats()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="icekv-prefix-spill")
        self._room = threading.BoundedSemaphore(MAX_PENDING)
        self._wait_when_full = wait_when_full

    def save(self, chain: bytes, rows: torch.Tensor, lost: Callable[[bytes], None] = lambda chain: None) -> None:
        """Write a page (``rows``: a copy the caller no longer touches) in the background;
        ``lost(chain)`` when it is not written (skipped, or the store failed)."""
        if not self._room.acquire(blocking=self._wait_when_full):
            self.stats.failed += 1
            lost(chain)
            return
        self._writer.submit(self._write, chain, rows, lost)

    def _write(self, chain: bytes, rows: torch.Tensor, lost: Callable[[bytes], None]) -> None:
        key = page_key(chain)
        try:
            self.backend.put(key, encode_page(rows, key, self.model_id, self.secret))
            self.stats.written += 1
        except (StoreError, StoreUnavailable) as e:
            self.stats.failed += 1
            lost(chain)
            log.warning("a prefix page was not written to the store: %s", e)
        finally:
            self._room.release()

    def load(self, chain: bytes) -> torch.Tensor | None:
        """The page's rows; None when the store lacks it or cannot give it (a corrupt entry is
        deleted, a foreign one left; either way the page is prefilled again)."""
        key = page_key(chain)
        try:
            blob = self.backend.get(key)
            if blob is None:
                return None
            rows = decode_page(blob, key, self.model_id, self.shape, self.dtype, self.secret)
        except CorruptEntry as e:
            self.stats.refused += 1
            log.warning("%s; deleted, the page is prefilled again", e)
            self._delete(key)
            return None
        except StoreError as e:
            self.stats.refused += 1
            log.warning("%s; the page is prefilled again", e)
            return None
        except StoreUnavailable as e:
            self.stats.failed += 1
            log.warning("a prefix page could not be read from the store: %s", e)
            return None
        self.stats.loaded += 1
        return rows

    def _delete(self, key: str) -> None:
        try:
            self.backend.delete(key)
        except StoreUnavailable:
            pass

    def flush(self) -> None:
        """Wait until every page handed to :meth:`save` is written (or failed)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)


def spill_prefixes(cache, backend, model_id: str, secret: bytes | None = None,
                   wait_when_full: bool = False) -> PrefixPageStore:
    """Put ``backend`` under the prefix cache of ``cache`` (an :class:`icekv.kv.PagedKVCache`)."""
    pool = cache.pool  # [L, 2, Hkv, pages, P, W]
    pages = PrefixPageStore(backend, model_id, tuple(pool.shape[:3] + pool.shape[4:]), pool.dtype, secret,
                            wait_when_full)
    cache.prefix.lower = PrefixTier(cache, pages)
    return pages
