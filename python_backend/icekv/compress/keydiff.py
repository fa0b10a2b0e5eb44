"""KeyDiff: keep the tokens whose keys point away from the chunk's mean key."""

from __future__ import annotations

from dataclasses import dataclass

from icekv.compress.scoring import keydiff_scores


@dataclass(frozen=True)
class KeyDiffCompressor:
    """KeyDiff: keep tokens whose keys differ most from the chunk's mean key direction."""

    chunk: int = 4096

    def score_steps(self, engine, seq_id, ids, kv_budget):
        """One slice: no model pass."""
        yield
        return keydiff_scores(engine.cache, seq_id, engine.model.args.num_layers, self.chunk)
