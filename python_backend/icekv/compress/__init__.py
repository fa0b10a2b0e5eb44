"""Prefix-time compression of reusable contexts: scoring methods, one global eviction threshold,
and the physically smaller compressed cache."""

from icekv.compress.compressed import CompressedContext, CompressedLayer
from icekv.compress.evict import evict
from icekv.compress.scoring import ScoringContext
from icekv.compress.methods import COMPRESSORS, make_compressor, parse_settings, resolved_settings

__all__ = ["COMPRESSORS", "CompressedContext", "CompressedLayer", "ScoringContext", "evict", "make_compressor",
           "parse_settings", "resolved_settings"]
