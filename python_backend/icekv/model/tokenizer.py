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

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos_id] if self._bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

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

    def token_id(self, text: str) -> None:
        return None  # bytes only: no token of a longer text

    def to_json(self) -> None:
        return None  # no tokenizer.json: no structured output
