"""Where compressed contexts live: a local directory (default) or Redis (shared by replicas).

Both keep at most ``max_bytes`` and evict the least recently used entries first. A failure of the
store itself (a full disk, an unreachable or slow Redis) raises StoreUnavailable, after bounded
waits, with a message that names no server path.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from icekv.store.format import StoreError, StoreUnavailable, check_key

log = logging.getLogger(__name__)
STALE_TMP_S = 3600.0  # a temporary file this old is a crashed writer's: removed at eviction
SCAN_EVERY = 256  # a local store's puts between two scans of its directory
LOW_WATER = 0.9  # an eviction frees entries down to this share of max_bytes


class LocalStore:
    """One file per key in a directory; the file's mtime is its last use.

    A put scans the directory (to learn its size and evict) only when this writer's running
    count of the store's bytes passes ``max_bytes``, or after SCAN_EVERY puts (other writers'
    entries are counted then), and an eviction makes room for the next tenth of the limit: a
    store of many small entries (prefix pages) costs a scan per many puts, not per put."""

    def __init__(self, root: str | Path, max_bytes: int = 8 << 30):
        self.root, self.max_bytes = Path(root), max_bytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file there, no permission, a read-only or missing mount
            raise StoreUnavailable(f"the context store cannot use directory {root}: {e.strerror}") from None
        self._bytes: int | None = None  # the store's bytes as of the last scan, plus the puts since
        self._puts_since_scan = 0

    def _path(self, key: str) -> Path:
        return self.root / f"{check_key(key)}.ctx"

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            blob = path.read_bytes()
            os.utime(path)  # mark as recently used
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"the context store cannot read an entry: {e.strerror}") from None
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            raise StoreError(f"entry of {len(blob)} bytes exceeds the store limit of {self.max_bytes}")
        path = self._path(key)
        tmp = self.root / f".{key}.{uuid.uuid4().hex}.tmp"  # one per writer: concurrent puts never mix
        try:
            self._write(tmp, blob)
            tmp.replace(path)  # atomic: readers never see half an entry
            self._sync_dir()
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreUnavailable(f"the context store cannot write an entry: {e.strerror}") from None
        self._puts_since_scan += 1
        if self._bytes is not None:
            self._bytes += len(blob)  # an entry replaced counts twice until the next scan: an overestimate
        if self._bytes is None or self._bytes > self.max_bytes or self._puts_since_scan >= SCAN_EVERY:
            self._evict()

    @staticmethod
    def _write(path: Path, blob: bytes) -> None:
        """The whole blob on disk (fsync) before it can be renamed into place."""
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.ctx")]

    def _evict(self) -> None:
        now = time.time()
        for tmp in self.root.glob(".*.tmp"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
        entries = []
        for path in self.root.glob("*.ctx"):
            try:
                entries.append((path.stat().st_mtime, path.stat().st_size, path))
            except FileNotFoundError:  # evicted by another writer meanwhile
                pass
        entries.sort()
        total = sum(size for _, size, _ in entries)
        if total > self.max_bytes:
            for _, size, victim in entries:
                if total <= self.max_bytes * LOW_WATER:
                    break
                total -= size
                victim.unlink(missing_ok=True)
        self._bytes, self._puts_since_scan = total, 0


class RedisStore:
    """Entries under ``icekv:ctx:<key>``; a sorted set orders keys by last use for LRU eviction."""

    def __init__(self, url: str, max_bytes: int = 8 << 30, prefix: str = "icekv:ctx:", password: str | None = None,
                 timeout_s: float = 5.0):
        """``password`` (from a secret, not the URL) overrides one in the URL; every call waits at
        most ``timeout_s``."""
        import redis

        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, password=password, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s, retry_on_timeout=False)
        self.max_bytes, self.prefix = max_bytes, prefix
        self._lru = prefix + "__lru__"
        self._sizes = prefix + "__sizes__"
        where = url.split("@")[-1]  # never a password in a message
        try:
            self.client.ping()
        except self._errors as e:
            raise StoreUnavailable(f"cannot reach Redis at {where}: {type(e).__name__}") from None
        self._fit_maxmemory()

    def _fit_maxmemory(self) -> None:
        """Keep entries below Redis' own ``maxmemory``, so Redis never evicts behind the LRU here."""
        try:
            limit = int(self.client.config_get("maxmemory").get("maxmemory", 0))
        except (self._errors + (ValueError,)):  # CONFIG may be disabled (managed Redis)
            return
        if 0 < limit and limit * 0.8 < self.max_bytes:
            log.warning("Redis maxmemory is %d bytes: the context store keeps at most %d (80%%), not %d",
                        limit, int(limit * 0.8), self.max_bytes)
            self.max_bytes = int(limit * 0.8)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._errors as e:
            raise StoreUnavailable(f"the Redis context store failed: {type(e).__name__}: {e}") from None

    def get(self, key: str) -> bytes | None:
        name = self.prefix + check_key(key)
        blob = self._call(self.client.get, name)
        if blob is not None:
            self._call(self.client.zadd, self._lru, {key: time.time()})
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            raise StoreError(f"entry of {len(blob)} bytes exceeds the store limit of {self.max_bytes}")
        pipe = self.client.pipeline()
        pipe.set(self.prefix + check_key(key), blob)
        pipe.zadd(self._lru, {key: time.time()})
        pipe.hset(self._sizes, key, len(blob))
        self._call(pipe.execute)
        self._evict()

    def delete(self, key: str) -> None:
        pipe = self.client.pipeline()
        pipe.delete(self.prefix + check_key(key))
        pipe.zrem(self._lru, key)
        pipe.hdel(self._sizes, key)
        self._call(pipe.execute)

    def keys(self) -> list[str]:
        return [k.decode() for k in self._call(self.client.zrange, self._lru, 0, -1)]

    def _evict(self) -> None:
        sizes = {k.decode(): int(v) for k, v in self._call(self.client.hgetall, self._sizes).items()}
        total = sum(sizes.values())
        for key in self.keys():  # oldest first
            if total <= self.max_bytes:
                break
            total -= sizes.get(key, 0)
            self.delete(key)
