"""Constrained decoding: a request's output held to a JSON schema or a Lark grammar by masking its
logits each step.

The grammar library is llguidance (Microsoft's, used by vLLM, SGLang and llama.cpp): it compiles a
JSON schema (most of draft 2020-12, with clear errors for what it cannot take), computes the
next-token mask over the real tokenizer's vocabulary in a few tens of microseconds on the CPU, has
no Python dependencies, and builds its tokenizer from the model folder's ``tokenizer.json``. Its
Lark dialect embeds JSON schemas and names a tokenizer's special tokens (forced tool calls use
both). A request without a grammar never touches it.
"""

from __future__ import annotations

import numpy as np
import torch

from icekv.errors import ConfigError
from icekv.config.request import SamplingConfig
from icekv.json_text import JSONTextError, read_json


# one space after separators, none elsewhere: the output reads as json.dumps writes it, and a model
# cannot spend its tokens on whitespace between them
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Compiles requests' grammars for one engine's tokenizer (``tokenizer_json``: the
    ``tokenizer.json`` text; ``eos``: the token ids that end a generation). The library's
    tokenizer is built at the first grammar: requests without one never pay for it."""

    def __init__(self, tokenizer_json: str | None, eos: list[int]):
        self._json, self._eos = tokenizer_json, eos
        self._tokenizer = None

    def for_request(self, sampling: SamplingConfig) -> Grammar | None:
        """A fresh matcher of the request's json_schema or grammar (None: it has neither);
        ConfigError naming the problem when the library cannot compile it."""
        if sampling.json_schema is not None:
            return self._matcher(self._schema(sampling.json_schema), "the JSON schema")
        if sampling.grammar is not None:
            return self._matcher(sampling.grammar, "the grammar")
        return None

    @staticmethod
    def _schema(schema: str) -> str:
        import llguidance

        try:
            parsed = read_json(schema)
        except JSONTextError as e:
            raise ConfigError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"the JSON schema must be a JSON object, got {type(parsed).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=COMPACT)
        except ValueError as e:  # what the library cannot hold, such as an integer past 64 bits
            raise ConfigError(f"the JSON schema cannot be compiled: {e}") from None

    def _matcher(self, grammar: str, what: str) -> Grammar:
        import llguidance

        if self._json is None:
            raise ConfigError("structured output needs the model's tokenizer.json (this model has none)")
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._json, eos_token=self._eos)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"{what} cannot be compiled: {matcher.get_error()}")
        return Grammar(matcher, self._tokenizer.vocab_size)


class Grammar:
    """One request's place in its grammar: which tokens may come next, and the ones it took."""

    def __init__(self, matcher, vocab: int):
        self._matcher, self._vocab = matcher, vocab

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids next at -inf (a new tensor; ids past the
        tokenizer's vocabulary, a model's padding, are forbidden too)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)  # [vocab]
        keep = torch.zeros(logits.shape[0], dtype=torch.bool)  # [V]
        keep[: len(allowed)] = torch.from_numpy(allowed[: logits.shape[0]])
        return logits.float().masked_fill(~keep, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed)."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Is the output whole (nothing may follow but the end)?"""
        return self._matcher.is_stopped()
