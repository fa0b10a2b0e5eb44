"""The compressed-context store: save a compressed context once, load it for every request."""

from __future__ import annotations

import os
from pathlib import Path

from icekv.compress.compressed import CompressedContext
from icekv.errors import ConfigError
from icekv.store.backends import LocalStore, RedisStore
from icekv.store.format import CorruptEntry, StoreError, StoreUnavailable, check_key, context_key, decode, encode

KEY_FILE_ENV = "ICEKV_STORE_KEY_FILE"  # the store's signing key (a mounted secret), shared by replicas
PASSWORD_FILE_ENV = "ICEKV_REDIS_PASSWORD_FILE"  # Redis' password (a mounted secret)
CLAIM_TTL_S = 30.0  # a compression claim lapses this long after its last renewal (its replica stopped)


def _read_secret(env: str) -> str | None:
    path = os.environ.get(env)
    if not path:
        return None
    try:
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{env}: cannot read the secret file ({e.strerror})") from None
    if not value:
        raise ConfigError(f"{env}: the secret file is empty")
    return value


class ContextStore:
    """Typed access over a byte store: verified load, signed save, and key computation for a model."""

    def __init__(self, backend, model_id: str, secret: bytes | None = None):
        self.backend, self.model_id, self.secret = backend, model_id, secret

    @classmethod
    def open(cls, location: str, model_id: str, max_bytes: int = 8 << 30) -> "ContextStore":
        """``redis://...`` for Redis, anything else is a local directory. Secrets come from files
        named by the environment, never from settings: $ICEKV_STORE_KEY_FILE (sign and verify
        entries with HMAC-SHA256; unsigned ones are refused) and $ICEKV_REDIS_PASSWORD_FILE."""
        key = _read_secret(KEY_FILE_ENV)
        secret = key.encode() if key else None
        if location.startswith(("redis://", "rediss://", "unix://")):
            return cls(RedisStore(location, max_bytes, password=_read_secret(PASSWORD_FILE_ENV)), model_id, secret)
        return cls(LocalStore(Path(location), max_bytes), model_id, secret)

    def key(self, token_ids: list[int], method: str, kv_budget: float, settings: dict | None = None) -> str:
        return context_key(self.model_id, token_ids, method, kv_budget, settings)

    def save(self, key: str, ctx: CompressedContext) -> int:
        blob = encode(ctx, key, self.model_id, self.secret)
        self.backend.put(key, blob)
        return len(blob)

    def has(self, key: str) -> bool:
        """Whether an entry is stored under ``key`` (unchecked: :meth:`load` verifies it)."""
        return self.backend.has(key)

    def claim(self, key: str, owner: str, ttl_s: float = CLAIM_TTL_S) -> bool:
        """Claim ``key`` to compress it (or renew ``owner``'s claim); False while another replica
        holds it. Renew well within ``ttl_s``; :meth:`release` when the entry is saved or given up."""
        return self.backend.claim(key, owner, ttl_s)

    def release(self, key: str, owner: str) -> None:
        """Give ``owner``'s claim on ``key`` back (nothing if another holds it now)."""
        self.backend.release(key, owner)

    def load(self, key: str) -> CompressedContext | None:
        """The entry, or None when absent. Raises StoreError for an entry this reader cannot use
        (deleted only when corrupt: a foreign or differently signed one may be another's)."""
        blob = self.backend.get(key)
        if blob is None:
            return None
        try:
            return decode(blob, key, self.model_id, self.secret)
        except CorruptEntry:
            self.backend.delete(key)
            raise


__all__ = ["CLAIM_TTL_S", "ContextStore", "CorruptEntry", "LocalStore", "RedisStore", "StoreError", "StoreUnavailable",
           "check_key", "context_key"]
