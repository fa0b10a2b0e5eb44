"""KeyDiff: keep the tokens whose keys point away from the chunk's mean key."""

from __future__ import annotations

from dataclasses import dataclass

from icekv.compress.scoring import ScoringContext


@dataclass(frozen=True)
class KeyDiffCompressor:
    """KeyDiff: keep tokens whose keys differ most from the chunk's mean key direction."""

    chunk: int = 4096

    def score_steps(self, ctx: ScoringContext):
        """One slice: no model pass."""
        yield
        return ctx.keydiff(self.chunk)
