"""The compressed-context store: save a compressed context once, load it for every request."""

from __future__ import annotations

from pathlib import Path

from icekv.compress.compressed import CompressedContext
from icekv.store.backends import LocalStore, RedisStore
from icekv.store.format import StoreError, check_key, context_key, decode, encode


class ContextStore:
    """Typed access over a byte store: verified load, save, and key computation for a model."""

    def __init__(self, backend, model_id: str):
        self.backend, self.model_id = backend, model_id

    @classmethod
    def open(cls, location: str, model_id: str, max_bytes: int = 8 << 30) -> "ContextStore":
        """``redis://...`` for Redis, anything else is a local directory."""
        if location.startswith(("redis://", "rediss://", "unix://")):
            return cls(RedisStore(location, max_bytes), model_id)
        return cls(LocalStore(Path(location), max_bytes), model_id)

    def key(self, token_ids: list[int], method: str, kv_budget: float, settings: dict | None = None) -> str:
        return context_key(self.model_id, token_ids, method, kv_budget, settings)

    def save(self, key: str, ctx: CompressedContext) -> int:
        blob = encode(ctx, key, self.model_id)
        self.backend.put(key, blob)
        return len(blob)

    def load(self, key: str) -> CompressedContext | None:
        """The entry, or None when absent. A corrupt or foreign entry is deleted and raises."""
        blob = self.backend.get(key)
        if blob is None:
            return None
        try:
            return decode(blob, key, self.model_id)
        except StoreError:
            self.backend.delete(key)
            raise


__all__ = ["ContextStore", "LocalStore", "RedisStore", "StoreError", "check_key", "context_key"]
