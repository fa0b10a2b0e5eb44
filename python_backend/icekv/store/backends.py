"""Where compressed contexts live: a local directory (default) or Redis (shared by replicas).

Both keep at most ``max_bytes`` and evict the least recently used entries first.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from icekv.store.format import StoreError, check_key


class LocalStore:
    """One file per key in a directory; the file's mtime is its last use."""

    def __init__(self, root: str | Path, max_bytes: int = 8 << 30):
        self.root, self.max_bytes = Path(root), max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / f"{check_key(key)}.ctx"

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        os.utime(path)  # mark as recently used
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            raise StoreError(f"entry of {len(blob)} bytes exceeds the store limit of {self.max_bytes}")
        tmp = self._path(key).with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(self._path(key))  # atomic: readers never see half an entry
        self._evict()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.ctx")]

    def _evict(self) -> None:
        entries = sorted(self.root.glob("*.ctx"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries)
        while total > self.max_bytes and entries:
            victim = entries.pop(0)
            total -= victim.stat().st_size
            victim.unlink(missing_ok=True)


class RedisStore:
    """Entries under ``icekv:ctx:<key>``; a sorted set orders keys by last use for LRU eviction."""

    def __init__(self, url: str, max_bytes: int = 8 << 30, prefix: str = "icekv:ctx:"):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=10)
        self.max_bytes, self.prefix = max_bytes, prefix
        self._lru = prefix + "__lru__"
        self._sizes = prefix + "__sizes__"
        try:
            self.client.ping()
        except Exception as e:
            raise StoreError(f"cannot reach Redis at {url}: {e}") from None

    def get(self, key: str) -> bytes | None:
        blob = self.client.get(self.prefix + check_key(key))
        if blob is not None:
            self.client.zadd(self._lru, {key: time.time()})
        return blob

    def put(self, key: str, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            raise StoreError(f"entry of {len(blob)} bytes exceeds the store limit of {self.max_bytes}")
        pipe = self.client.pipeline()
        pipe.set(self.prefix + check_key(key), blob)
        pipe.zadd(self._lru, {key: time.time()})
        pipe.hset(self._sizes, key, len(blob))
        pipe.execute()
        self._evict()

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + check_key(key))
        self.client.zrem(self._lru, key)
        self.client.hdel(self._sizes, key)

    def keys(self) -> list[str]:
        return [k.decode() for k in self.client.zrange(self._lru, 0, -1)]

    def _evict(self) -> None:
        sizes = {k.decode(): int(v) for k, v in self.client.hgetall(self._sizes).items()}
        total = sum(sizes.values())
        for key in self.keys():  # oldest first
            if total <= self.max_bytes:
                break
            total -= sizes.get(key, 0)
            self.delete(key)
