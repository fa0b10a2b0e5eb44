"""Incremental detokenization with stop strings, for streaming text out token by token."""

from __future__ import annotations

from icekv.model import Tokenizer


class TextStream:
    """Feed token ids one at a time; get back only the new, complete text.

    Text is held back while it ends in an incomplete UTF-8 sequence (a multi-byte character split
    across tokens) or in what may be the start of a stop string; it is cut at the first stop
    string, which is never emitted. Each token costs work bounded by the stop strings' lengths, not
    by the text so far: only the newest tokens are decoded (relative to the token before them, so
    tokenizers that drop a leading space decode right), and stop strings are looked for only in the
    held-back tail plus the new text, where a new occurrence must lie.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False
        self._held = ""  # decoded, not emitted: a possible start of a stop string
        self._prefix = self._read = 0  # token_ids[_prefix:_read] were decoded already (context for the next)

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        self.token_ids.append(token)
        if self.stopped:
            return ""
        new = self._decode_new(final=False)
        return "" if new is None else self._emit(self._held + new, final=False)

    def flush(self) -> str:
        """Whatever is still held back at the end of generation."""
        if self.stopped:
            return ""
        return self._emit(self._held + self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str | None:
        """Text of the tokens after ``_read``; None while it ends in an incomplete character."""
        before = self.tokenizer.decode(self.token_ids[self._prefix:self._read])
        after = self.tokenizer.decode(self.token_ids[self._prefix:])
        if after.endswith("\ufffd") and not final:
            return None
        self._prefix, self._read = self._read, len(self.token_ids)
        return after[len(before):]

    def _emit(self, pending: str, final: bool) -> str:
        cuts = [i for i in (pending.find(s) for s in self.stop) if i >= 0]
        if cuts:
            pending, self.stopped, hold = pending[:min(cuts)], True, 0
        else:
            hold = 0 if final else self._partial_stop(pending)
        delta, self._held = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.text += delta
        return delta

    def _partial_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could be the start of a stop string."""
        return max(
            (n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
            default=0,
        )
