"""Where compressed contexts live: a local directory (default) or Redis (shared by replicas).

Both keep at most ``max_bytes`` and evict the least recently used entries first. A failure of the
store itself (a full disk, an unreachable or slow Redis) raises StoreUnavailable, after bounded
waits, with a message that names no server path.

Both also hold claims: a replica about to compress a context claims its key for ``ttl_s`` seconds
and renews the claim while it works, so that the other replicas sharing the store wait for its
entry instead of compressing the same context again. A claim not renewed in time (its replica
died) lapses, and another replica takes it over.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from icekv.store.format import StoreError, StoreUnavailable, check_key

log = logging.getLogger(__name__)
STALE_TMP_S = 3600.0  # a temporary file or a claim this old is a crashed writer's: removed at eviction
SCAN_EVERY = 256  # a local store's puts between two scans of its directory
LOW_WATER = 0.9  # an eviction frees entries down to this share of max_bytes
CLAIMS_LOCK = ".claims.lock"  # a local store's lock over its claim files
_CLAIM = """local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0"""  # take a free claim or renew one's own, atomically
_RELEASE = """if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0"""  # delete a claim only if its owner still holds it


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

    def has(self, key: str) -> bool:
        return self._path(key).exists()

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take ``key``'s claim for ``owner`` for ``ttl_s`` seconds, or renew it if ``owner`` holds
        it; False while another holds it. A claim file holds its owner and its deadline; the
        directory's lock makes reading and writing it one step across processes."""
        path = self._claim_path(key)
        try:
            with self._claims_locked():
                held = _claim_holder(path)
                if held is not None and held != owner:
                    return False
                path.write_text(f"{owner}\n{time.time() + ttl_s}")
                return True
        except OSError as e:
            raise StoreUnavailable(f"the context store cannot claim an entry: {e.strerror}") from None

    def release(self, key: str, owner: str) -> None:
        """Give ``key``'s claim back, if ``owner`` still holds it."""
        path = self._claim_path(key)
        try:
            with self._claims_locked():
                if _claim_holder(path) == owner:
                    path.unlink(missing_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"the context store cannot release a claim: {e.strerror}") from None

    def _claim_path(self, key: str) -> Path:
        return self.root / f".{check_key(key)}.claim"

    @contextmanager
    def _claims_locked(self):
        """The directory's claims lock (``flock``: between the processes of one host)."""
        with open(self.root / CLAIMS_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # unlocked as the file closes

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.ctx")]

    def _evict(self) -> None:
        now = time.time()
        for tmp in [*self.root.glob(".*.tmp"), *self.root.glob(".*.claim")]:
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


def _claim_holder(path: Path) -> str | None:
    """The owner of the claim in ``path``; None when there is none, it lapsed, or it is unreadable."""
    try:
        owner, deadline = path.read_text().rsplit("\n", 1)
        return owner if float(deadline) > time.time() else None
    except (FileNotFoundError, ValueError):
        return None


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

    def has(self, key: str) -> bool:
        return bool(self._call(self.client.exists, self.prefix + check_key(key)))

    def claim(self, key: str, owner: str, ttl_s: float) -> bool:
        """Take ``key``'s claim for ``owner`` for ``ttl_s`` seconds, or renew it if ``owner`` holds
        it; False while another holds it (Redis expires a claim nobody renews)."""
        name = self._claim_name(key)
        return bool(self._call(self.client.eval, _CLAIM, 1, name, owner, max(1, int(ttl_s * 1000))))

    def release(self, key: str, owner: str) -> None:
        """Give ``key``'s claim back, if ``owner`` still holds it."""
        self._call(self.client.eval, _RELEASE, 1, self._claim_name(key), owner)

    def _claim_name(self, key: str) -> str:
        return f"{self.prefix}__claim__:{check_key(key)}"

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
