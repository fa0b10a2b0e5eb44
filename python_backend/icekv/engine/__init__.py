"""Request execution: prefill, decode, sampling, streaming text and statistics."""

from icekv.engine.engine import Engine, Generation, KVStats

__all__ = ["Engine", "Generation", "KVStats"]
