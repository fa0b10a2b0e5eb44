"""The on-store format of a compressed context: one safetensors blob, versioned and checksummed.

Metadata carries the format version, the entry's key, the model id, how it was compressed and a
sha256 over every tensor's bytes; :func:`decode` refuses anything that does not match, so a
corrupt or foreign entry is never used.
"""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load, save

from icekv.compress.compressed import CompressedContext, CompressedLayer
from icekv.errors import IcekvError

FORMAT = "icekv-compressed-context"
VERSION = "1"
FIELDS = ("k", "v", "page_len", "positions", "head_indptr")


class StoreError(IcekvError):
    """A stored entry is missing, corrupt, foreign or of another version."""


def context_key(model_id: str, token_ids: list[int], method: str, kv_budget: float, settings: dict | None = None) -> str:
    """The store key: a hash of everything that determines the compressed cache."""
    payload = json.dumps({"model": model_id, "tokens": token_ids, "method": method, "kv_budget": kv_budget,
                          "settings": settings or {}, "format": VERSION}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def check_key(key: str) -> str:
    """``key`` if it is a context key (a sha256 hex digest, as :func:`context_key` makes); a
    StoreError naming the problem otherwise, before it reaches a file name or a Redis key."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        shown = key if len(key) <= 80 else key[:77] + "..."
        raise StoreError(f"invalid context_key {shown!r}: expected 64 lowercase hex digits (a sha256 digest)")
    return key


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def encode(ctx: CompressedContext, key: str, model_id: str) -> bytes:
    tensors = {f"{i}.{f}": getattr(layer, f).contiguous() for i, layer in enumerate(ctx.layers) for f in FIELDS}
    meta = {"format": FORMAT, "version": VERSION, "key": key, "model_id": model_id, "method": ctx.method,
            "kv_budget": repr(ctx.kv_budget), "length": str(ctx.length), "page_size": str(ctx.page_size),
            "layers": str(len(ctx.layers)), "full_bytes": str(ctx.full_bytes), "sha256": _checksum(tensors)}
    return save(tensors, metadata=meta)


def decode(blob: bytes, key: str, model_id: str) -> CompressedContext:
    """Parse and verify an entry; raises StoreError naming what is wrong."""
    try:
        n_header = int.from_bytes(blob[:8], "little")
        meta = json.loads(blob[8 : 8 + n_header]).get("__metadata__", {})
        tensors = load(blob)
    except Exception as e:
        raise StoreError(f"entry {key[:12]}... is not a readable safetensors blob ({type(e).__name__})") from None
    if meta.get("format") != FORMAT:
        raise StoreError(f"entry {key[:12]}... is not an icekv compressed context")
    if meta.get("version") != VERSION:
        raise StoreError(f"entry {key[:12]}... has format version {meta.get('version')}, this icekv reads {VERSION}")
    if meta.get("key") != key or meta.get("model_id") != model_id:
        raise StoreError(f"entry {key[:12]}... belongs to another context or model")
    if _checksum(tensors) != meta.get("sha256"):
        raise StoreError(f"entry {key[:12]}... is corrupt (checksum mismatch)")
    layers = [CompressedLayer(**{f: tensors[f"{i}.{f}"] for f in FIELDS}) for i in range(int(meta["layers"]))]
    return CompressedContext(int(meta["length"]), int(meta["page_size"]), layers, meta["method"],
                             float(meta["kv_budget"]), int(meta["full_bytes"]))
