"""Incremental detokenization with stop strings, for streaming text out token by token."""

from __future__ import annotations

from icekv.model import Tokenizer


class TextStream:
    """Feed token ids one at a time; get back only the new, complete text.

    Text is held back while it ends in an incomplete UTF-8 sequence (a multi-byte character split
    across tokens) or in what may be the start of a stop string; it is cut at the first stop
    string, which is never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        self.token_ids.append(token)
        full = self.tokenizer.decode(self.token_ids)
        cuts = [full.find(s) for s in self.stop if s and s in full]
        if cuts:
            full, self.stopped = full[: min(cuts)], True
        elif full.endswith("\ufffd"):
            return ""
        else:
            full = full[: len(full) - self._partial_stop(full)]
        delta, self.text = full[len(self.text) :], full
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could be the start of a stop string."""
        return max(
            (n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
            default=0,
        )

    def flush(self) -> str:
        """Whatever is still held back at the end of generation."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids)
        delta, self.text = full[len(self.text) :], full
        return delta
