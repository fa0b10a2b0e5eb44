"""The on-store format of a compressed context: one safetensors blob, versioned and signed.

Metadata carries the format version, the entry's key, the model id, how it was compressed and a
digest over the metadata and every tensor's bytes: a sha256, or with a store key (a secret shared
by the replicas) an HMAC-SHA256, so that whoever can write the store but lacks the key cannot
plant a context. :func:`decode` refuses anything that does not match, so a corrupt, foreign or
forged entry is never used.
"""

from __future__ import annotations

import hashlib
import hmac
import json

import torch
from safetensors.torch import load, save

from icekv.compress.compressed import CompressedContext, CompressedLayer
from icekv.compress.methods import resolved_settings
from icekv.errors import IcekvError
from icekv.kv.quant import KVFormat

FORMAT = "icekv-compressed-context"
VERSION = "2"
FIELDS = ("k", "v", "page_len", "positions", "head_indptr")


class StoreError(IcekvError):
    """A stored entry is invalid for this reader: foreign, of another version, unsigned, or its key
    malformed. Left in the store (another reader may own it); never used."""


class CorruptEntry(StoreError):
    """A stored entry is unreadable or fails its digest: deleted when found."""


class StoreUnavailable(IcekvError):
    """The store itself failed (Redis unreachable or timing out, a disk error): retry later."""


def context_key(model_id: str, token_ids: list[int], method: str, kv_budget: float, settings: dict | None = None) -> str:
    """The store key: a hash of everything that determines the compressed cache (the method's
    settings with their defaults filled in: a default that changes changes the key)."""
    payload = json.dumps({"model": model_id, "tokens": token_ids, "method": method, "kv_budget": kv_budget,
                          "settings": resolved_settings(method, settings), "format": VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def check_key(key: str) -> str:
    """``key`` if it is a context key (a sha256 hex digest, as :func:`context_key` makes); a
    StoreError naming the problem otherwise, before it reaches a file name or a Redis key."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        shown = key if len(key) <= 80 else key[:77] + "..."
        raise StoreError(f"invalid context_key {shown!r}: expected 64 lowercase hex digits (a sha256 digest)")
    return key


def digest(meta: dict[str, str], tensors: dict[str, torch.Tensor], secret: bytes | None) -> str:
    """sha256 (no secret) or HMAC-SHA256 over the metadata (all but the digest) and every tensor."""
    h = hmac.new(secret, digestmod=hashlib.sha256) if secret else hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-dim too
    return h.hexdigest()


def digest_scheme(secret: bytes | None) -> str:
    return "hmac-sha256" if secret else "sha256"


def encode(ctx: CompressedContext, key: str, model_id: str, secret: bytes | None = None) -> bytes:
    """The entry's bytes, signed with ``secret`` when given."""
    tensors = {f"{i}.{f}": getattr(layer, f).contiguous() for i, layer in enumerate(ctx.layers) for f in FIELDS}
    meta = {"format": FORMAT, "version": VERSION, "key": key, "model_id": model_id, "method": ctx.method,
            "kv_budget": repr(ctx.kv_budget), "length": str(ctx.length), "page_size": str(ctx.page_size),
            "layers": str(len(ctx.layers)), "full_bytes": str(ctx.full_bytes), "kv_dtype": ctx.kv_dtype,
            "digest_scheme": digest_scheme(secret)}
    meta["digest"] = digest(meta, tensors, secret)
    return save(tensors, metadata=meta)


def verified(blob: bytes, key: str, model_id: str, fmt: str, version: str, secret: bytes | None,
             what: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An entry's metadata and tensors, once it is shown to be a ``fmt`` entry of ``version`` made
    for ``key`` and ``model_id`` and signed as this store signs (``what`` names it in the errors:
    "context", "prefix"); StoreError, or CorruptEntry when it is unreadable or fails its digest."""
    try:
        n_header = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8 : 8 + n_header]).get("__metadata__", {})
        tensors = load(blob)
        if not isinstance(meta, dict):
            raise TypeError("metadata is not an object")
    except Exception as e:
        raise CorruptEntry(f"entry {key[:12]}... is not a readable safetensors blob ({type(e).__name__})") from None
    if meta.get("format") != fmt:
        raise StoreError(f"entry {key[:12]}... is not an {fmt} entry")
    if meta.get("version") != version:
        raise StoreError(f"entry {key[:12]}... has format version {meta.get('version')}, this icekv reads {version}")
    if meta.get("key") != key or meta.get("model_id") != model_id:
        raise StoreError(f"entry {key[:12]}... belongs to another {what} or model")
    if meta.get("digest_scheme") != digest_scheme(secret):
        raise StoreError(f"entry {key[:12]}... is signed with {meta.get('digest_scheme')}, this store expects "
                         f"{digest_scheme(secret)} (is the store key set alike on every replica?)")
    if not hmac.compare_digest(digest(meta, tensors, secret).encode(), str(meta.get("digest")).encode()):
        if secret:  # forged, or another key: not ours to delete
            raise StoreError(f"entry {key[:12]}... is not signed with this store's key")
        raise CorruptEntry(f"entry {key[:12]}... is corrupt (digest mismatch)")
    return meta, tensors


def decode(blob: bytes, key: str, model_id: str, secret: bytes | None = None) -> CompressedContext:
    """Parse and verify an entry (its HMAC under ``secret`` when given); raises StoreError (or
    CorruptEntry) naming what is wrong."""
    meta, tensors = verified(blob, key, model_id, FORMAT, VERSION, secret, "context")
    # a digest proves the bytes are as written, not that the writer was icekv (an unkeyed store's
    # sha256 anyone can make): the entry must also hold together
    try:
        length, page_size, n_layers = int(meta["length"]), int(meta["page_size"]), int(meta["layers"])
        if length < 1 or page_size < 1 or n_layers < 1 or int(meta["full_bytes"]) < 0 \
                or not 0 < float(meta["kv_budget"]) <= 1:
            raise ValueError("length, page_size and layers must be positive, full_bytes not negative, "
                             "kv_budget in (0, 1]")
        layers = [CompressedLayer(**{f: tensors[f"{i}.{f}"] for f in FIELDS}) for i in range(n_layers)]
        for layer in layers:
            layer.check(page_size, length)
        kv_dtype = KVFormat(meta.get("kv_dtype", "auto")).name  # ValueError: not a format this icekv reads
        ctx = CompressedContext(length, page_size, layers, meta["method"], float(meta["kv_budget"]),
                                int(meta["full_bytes"]), kv_dtype)
    except (KeyError, ValueError) as e:
        raise StoreError(f"entry {key[:12]}... is malformed: {e}") from None
    if len(tensors) != len(FIELDS) * len(layers):
        raise StoreError(f"entry {key[:12]}... is malformed: {len(tensors)} tensors for {len(layers)} layers")
    return ctx
