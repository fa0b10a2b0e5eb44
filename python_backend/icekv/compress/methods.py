"""The registry of prefix compressors (one dataclass per file).

Every method maps a prefilled context to scores S [layer, KV head, token] with
``score_steps(engine, seq_id, ids, kv_budget)``: a generator that yields after each model pass
(so a server can interleave other requests' steps) and returns the scores;
:func:`icekv.compress.evict` turns them into a physically smaller cache. None of them sees the
future questions.
"""

from __future__ import annotations

from icekv.compress.keydiff import KeyDiffCompressor
from icekv.compress.kv2 import KV2Compressor
from icekv.compress.kvzip import KVzipCompressor
from icekv.compress.snapkv import SnapKVCompressor
from icekv.compress.streaming import StreamingCompressor
from icekv.errors import ConfigError

COMPRESSORS = {
    "kv2": KV2Compressor,
    "kvzip": KVzipCompressor,
    "snapkv": SnapKVCompressor,
    "keydiff": KeyDiffCompressor,
    "streaming": StreamingCompressor,
}


def make_compressor(method: str, **settings):
    if method not in COMPRESSORS:
        raise ConfigError(f"unknown compression method {method!r}; choose from {', '.join(COMPRESSORS)}")
    try:
        return COMPRESSORS[method](**settings)
    except TypeError as e:
        raise ConfigError(f"{method}: {e}") from None
