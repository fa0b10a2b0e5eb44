"""A request's own settings: how it samples and whether the prefix cache serves it (plain data,
re-exported by :mod:`icekv.config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from icekv.errors import ConfigError

MAX_TOP_LOGPROBS = 20  # alternatives reported per token, as OpenAI allows


@dataclass(frozen=True)
class PromptCaching:
    """What the prefix cache may do with one request's prompt: serve it and keep its pages
    (``enabled``), and keep them ahead of the LRU order for ``retention_s`` seconds after the
    request ends (an agent's context across a tool call); pool pressure still evicts them."""

    enabled: bool = True
    retention_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.retention_s >= 0:
            raise ConfigError(f"cache_retention_s must be >= 0, got {self.retention_s}")


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked. ``temperature == 0`` means greedy decoding.

    ``logprobs`` reports the model's own log-probabilities (of the logits before any penalty, bias
    or temperature, as vLLM's default). Before sampling, the logits are adjusted as OpenAI's API and
    vLLM define (:func:`icekv.engine.sampling.
    adjusted_logits`): ``repetition_penalty`` divides the positive logits (multiplies the negative
    ones) of every token seen in the prompt or the output; ``frequency_penalty`` is subtracted once
    per time a token was generated, ``presence_penalty`` once if it was; ``logit_bias`` adds to
    the logits of the token ids it names. ``json_schema`` (JSON text) holds the output to that
    schema, ``grammar`` to a Lark grammar (:mod:`icekv.engine.grammar`): the tokens they forbid
    are masked before sampling. ``forced_tokens`` (teacher forcing) is the output itself: each
    step feeds the next of them in place of a sampled token, so a decode under any policy runs
    over exactly that text (:mod:`icekv.eval.fidelity` compares policies so).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # None: none; k: each new token's log-probability and the k most likely ones
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (the whole prompt is prefilled)
    json_schema: str | None = None  # the output is JSON valid under this schema (checked by the engine at submit)
    grammar: str | None = None  # the output matches this Lark grammar, llguidance's dialect (forced tool calls)
    forced_tokens: tuple[int, ...] = ()  # the whole output, fed in place of sampled tokens (an end-of-sequence
    # one does not end it early; max_tokens: its length)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ConfigError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ConfigError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.json_schema is not None and self.grammar is not None:
            raise ConfigError("an output is held to one grammar: send json_schema or grammar, not both")
        if self.forced_tokens and self.max_tokens != len(self.forced_tokens):
            raise ConfigError(f"max_tokens must be the number of forced_tokens ({len(self.forced_tokens)}), "
                              f"got {self.max_tokens}")
        if any(t < 0 for t in self.forced_tokens):
            raise ConfigError("forced_tokens must be token ids >= 0")
        if self.forced_tokens and (self.stop or self.json_schema is not None or self.grammar is not None):
            raise ConfigError("forced_tokens are the whole output: stop, json_schema and grammar do not apply")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ConfigError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Does any penalty or bias change the logits? (Requests without them skip the step.)"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)
