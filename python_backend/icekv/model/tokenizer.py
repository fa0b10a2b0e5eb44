"""Text <-> token ids with the model folder's ``tokenizer.json`` (no transformers import)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from icekv.errors import ModelLoadError


class Tokenizer:
    """Encodes prompts as the Hugging Face tokenizer of the same folder does, and decodes streams."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in model directory {model_dir}")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._bos_id = self._tok.token_to_id(cfg["bos_token"]) if cfg.get("add_bos_token") else None
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._dropped: set[int] | None = None  # special ids decoding drops; None: all of them

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos_id] if self._bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` without special tokens, but those :meth:`keep_in_text` names."""
        if self._dropped is None:
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._tok.decode([i for i in ids if i not in self._dropped], skip_special_tokens=False)

    def keep_in_text(self, texts: tuple[str, ...]) -> None:
        """Decode the special tokens among ``texts`` as their text (markup a reader of the output
        needs, such as a tool-call format's tags); the others are still dropped. Set once, before
        any request decodes."""
        kept = {self._special[t] for t in texts if t in self._special}
        self._dropped = set(self._special.values()) - kept if kept else None

    def token_id(self, text: str) -> int | None:
        """The id of ``text`` where the vocabulary holds it as one token (an added or special one)."""
        return self._tok.token_to_id(text)

    def to_json(self) -> str:
        """The tokenizer as its ``tokenizer.json`` text (for a grammar library's own tokenizer)."""
        return self._tok.to_str()


class ByteTokenizer:
    """UTF-8 bytes as token ids, for a random-weight model (:mod:`icekv.model.random`), which has
    no vocabulary: prompts still encode, and ids past 255 decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")

    def keep_in_text(self, texts: tuple[str, ...]) -> None:
        """No special tokens to keep."""

    def token_id(self, text: str) -> None:
        return None  # bytes only: no token of a longer text

    def to_json(self) -> None:
        return None  # no tokenizer.json: no structured output
