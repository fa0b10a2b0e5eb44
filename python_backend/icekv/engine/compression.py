"""Compressing a reusable context as scheduled work, so serving streams keep flowing meanwhile.

The context's prefill is an ordinary (prefill-only) request: the engine's steps run it in chunks
beside everyone else's tokens. Its scoring then runs in slices (one model pass over one chunk of
re-fed tokens each) that the caller interleaves with engine steps; eviction and packing follow
the last slice. :meth:`Engine.compress` drives one job alone; the serving loop drives its jobs
between the steps of its other requests.
"""

from __future__ import annotations

from typing import Generator

import torch

from icekv.compress import CompressedContext, ScoringContext, evict, make_compressor
from icekv.engine.backends import check_contexts_allowed
from icekv.engine.sequence import Cancelled


def scoring_context(engine, seq_id: int, ids: list[int], kv_budget: float) -> ScoringContext:
    """What a compressor may see of ``engine``: the prefilled context, the model and the tokenizer."""
    return ScoringContext(engine.model, engine.cache, seq_id, list(ids), engine.tokenizer.encode, kv_budget)


class CompressionJob:
    """One context being compressed: ``done`` once ``result`` or ``error`` is set."""

    def __init__(self, engine, context_ids: list[int], method: str, kv_budget: float, **settings):
        self.engine, self.ids, self.method, self.kv_budget = engine, list(context_ids), method, kv_budget
        check_contexts_allowed(engine.model.args)
        self.compressor = make_compressor(method, **settings)  # ConfigError before anything is queued
        self.seq = engine.submit_prefill(self.ids)
        self._scoring: Generator[None, None, torch.Tensor] | None = None
        self._prefilled = None
        self.result: CompressedContext | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def scoring(self) -> bool:
        """The prefill is over: :meth:`advance` has model work to do."""
        return not self.done and self.seq.done

    def advance(self) -> None:
        """One slice of scoring once the prefill is done (between engine steps); a no-op before."""
        if not self.scoring:
            return
        try:
            if self._scoring is None:
                if self.seq.error is not None:
                    raise self.seq.error
                self._prefilled = self.seq.result
                self._scoring = self.compressor.score_steps(scoring_context(self.engine, self._prefilled.seq_id,
                                                                            self.ids, self.kv_budget))
            next(self._scoring)
        except StopIteration as finished:
            scores = finished.value  # [L, Hkv, T]
            try:
                keep = evict(scores, self.kv_budget)
                self.result = CompressedContext.from_cache(self.engine.cache, self._prefilled.seq_id, keep,
                                                           self.method, self.kv_budget)
            except Exception as e:
                self.error = e
            self._release()
        except Exception as e:
            self.error = e
            self._release()

    def cancel(self) -> None:
        """Stop: the prefill is cancelled at the next step, or the scoring dropped now."""
        if self.done:
            return
        self.seq.cancel()  # a no-op once its prefill is done
        if self.seq.done and self.seq.error is None and self._prefilled is None:
            self._prefilled = self.seq.result  # prefilled, scoring not begun: its KV is still held
        if self._scoring is not None:
            self._scoring.close()
        self.error = Cancelled("compression cancelled")
        self._release()

    def _release(self) -> None:
        if self._prefilled is not None:
            self.engine.release(self._prefilled)
            self._prefilled = None
