"""One request inside the engine: its settings, where it is (waiting, prefill, decode, done), and
what it has produced. The scheduler decides when it runs; the step runner moves it forward."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from icekv.compress import CompressedContext
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.engine.grammar import Grammar
from icekv.engine.kv_manager import Admission
from icekv.engine.results import Generation, Prefilled
from icekv.engine.sampling import adjusted_logits, sample_next, token_logprobs
from icekv.engine.text_stream import TextStream
from icekv.errors import IcekvError
from icekv.policies import PolicyPlan

OnText = Callable[[str], None]
OnProgress = Callable[[int, int], None]
OnLogits = Callable[[torch.Tensor], None]  # each decode step's logits [V], before any adjustment


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Cancelled(IcekvError):
    """The request was cancelled (by its client, or because the engine stopped)."""


@dataclass(frozen=True)
class Request:
    """What was asked, fixed at submit. ``prefilled``: decode over an existing prompt's KV, after
    prefilling the rest of ``prompt_ids`` if they continue it (its pages stay: what this request
    adds is truncated afterwards); ``prefill_only``: stop after prefill and keep the pages (the
    result is then a :class:`Prefilled`); ``probe``: measure attention recall at each decode step;
    ``caching``: what the prefix cache may do with its prompt."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    plan: PolicyPlan  # its decode method and settings, resolved once at submit
    context: CompressedContext | None = None
    prefilled: Prefilled | None = None
    prefill_only: bool = False
    probe: bool = False
    caching: PromptCaching = PromptCaching()


@dataclass(eq=False)
class Sequence:
    """One submitted request inside the engine: the :class:`Request`, what admission charges it,
    and where it is (its run state, written by the step runner)."""

    seq_id: int
    request: Request
    on_text: OnText | None = None
    on_progress: OnProgress | None = None
    on_logits: OnLogits | None = None
    admission: Admission = Admission()  # what admission charges (worst case): set by the engine at submit
    # progress
    phase: Phase = Phase.WAITING
    prefill_done: int = 0  # prompt tokens already through the model
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not prefilled)
    backend: object = None  # this phase's attention backend
    decoder_ready: bool = False  # backend is the decode one (set up at the first decode step)
    index: object = None  # a PrefillIndex built during prefill
    window_queries: dict | None = None  # layer -> the prompt's last queries [W, Hq, D], kept by its prefill
    next_token: int | None = None  # sampled, to be fed by the next decode step
    stream: TextStream | None = None
    eos: set[int] = field(default_factory=set)
    logits: torch.Tensor | None = None  # [V] after the prompt (kept for a prefill-only request)
    generator: torch.Generator | None = None
    grammar: Grammar | None = None  # where its output is in its json_schema or grammar (set at submit)
    step_s: list[float] = field(default_factory=list)  # each decode step's wall time
    logprobs: list[dict] = field(default_factory=list)  # per sampled token (an end-of-sequence one too), when asked
    prompt_logprobs: list[dict] = field(default_factory=list)  # per prompt token (the first's logprob None), when asked
    queued_at: float = 0.0  # time.monotonic() when it entered the scheduler's queue
    t_prefill: float = 0.0
    prefill_s: float = 0.0
    t_decode: float = 0.0
    finish_reason: str = "length"
    result: Generation | Prefilled | None = None
    error: BaseException | None = None
    cancel_error: BaseException | None = None  # why it was cancelled, when not by its client
    _cancel: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)

    # ---- called from any thread
    def cancel(self, error: BaseException | None = None) -> None:
        """Ask the engine to drop this request at its next step (queued or running); it ends with
        ``error`` (default: Cancelled)."""
        self.cancel_error = error or self.cancel_error
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    # ---- called by the engine's step
    @property
    def tokens_held(self) -> int:
        """The most tokens of its own this request may hold: prompt + max_tokens."""
        return len(self.request.prompt_ids) + self.request.sampling.max_tokens

    @property
    def selects(self) -> bool:
        """Does its decode select pages? Under a sparse policy, over a compressed context or when
        its tokens may outgrow the budget (within it, it attends every token: ``PolicyPlan.selects``)."""
        r = self.request
        return r.plan.sparse and (r.context is not None or r.plan.selects(self.tokens_held))

    @property
    def shares_index(self) -> bool:
        """May its decode continue a finished request's page index, and leave its own for the next
        (:mod:`icekv.policies.index_cache`)? When it uses the prefix cache and selects under a
        policy whose index grows by insertion."""
        return self.uses_prefix_cache and self.request.plan.extends_index and self.selects

    @property
    def uses_prefix_cache(self) -> bool:
        """May the prefix cache serve its prompt and keep its pages? A plain prompt only: not one
        over a compressed context or a prefilled prompt (their positions and pages are their own),
        nor a sparse prefill kept for later decodes (its index is built from the prompt's pass), a
        probe or a request scoring its prompt (each needs its whole prompt through the model)."""
        r = self.request
        return (r.caching.enabled and r.context is None and r.prefilled is None
                and not (r.prefill_only and r.plan.sparse) and not r.probe and r.sampling.prompt_logprobs is None)

    @property
    def most_cached_tokens(self) -> int:
        """The most prompt tokens a cached prefix may stand in for: not the last one (its logits
        start the decode) nor the policy's observation window (its prefill keeps their queries)."""
        r = self.request
        return len(r.prompt_ids) - max(1, r.plan.window_queries_kept(False))

    def tokens_to_cache(self) -> list[int] | None:
        """The tokens whose KV the prefix cache may keep when it ends (the cache keeps those its
        pages hold): the prompt as far as it was prefilled, and what it generated only where every
        step attended all tokens (a selecting decode writes K/V a full prefill would not); None: none."""
        if not self.uses_prefix_cache:
            return None
        r = self.request
        if self.error is not None or self.selects or self.stream is None:
            return r.prompt_ids[: self.prefill_done]
        return r.prompt_ids + self.stream.token_ids

    @property
    def remaining_prompt(self) -> int:
        return len(self.request.prompt_ids) - self.prefill_done

    @property
    def decoding(self) -> bool:
        """Its next step feeds one token (the prompt is in the cache, its own or ``prefilled``)."""
        return self.phase is Phase.DECODE or (self.phase is Phase.WAITING and self.request.prefilled is not None
                                              and not self.remaining_prompt)

    def start_decode(self, tokenizer, eos: set[int], logits: torch.Tensor) -> None:
        """The prompt is in the cache: sample the first token from ``logits`` [V]."""
        s = self.request.sampling
        self.generator = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        self.stream = TextStream(tokenizer, s.stop)
        self.eos = set() if s.ignore_eos else eos
        self.phase, self.t_decode = Phase.DECODE, time.perf_counter()
        self.accept(logits)

    def accept(self, logits: torch.Tensor) -> None:
        """Sample the next token from logits [V] (or take the next forced one); finishes on EOS, a
        stop string or max_tokens."""
        s, raw = self.request.sampling, logits
        if self.on_logits:
            self.on_logits(raw)
        if s.adjusts_logits:
            logits = adjusted_logits(logits, s, torch.tensor(self.request.prompt_ids, dtype=torch.long),
                                     torch.tensor(self.stream.token_ids, dtype=torch.long))
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        forced = s.forced_tokens
        token = forced[len(self.stream.token_ids)] if forced else sample_next(logits, s, self.generator)
        if s.logprobs is not None:  # an end-of-sequence token too, as vLLM reports it
            self.logprobs += token_logprobs(raw[None], [token], s.logprobs, self.stream.tokenizer.decode)
        if token in self.eos and not forced:
            self.finish_reason = "stop"
            return self._emit_last()
        self._emit(self.stream.push(token))
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.stream.stopped or (self.grammar is not None and self.grammar.complete):
            self.finish_reason = "stop"
            return self._emit_last()
        if len(self.stream.token_ids) >= self.request.sampling.max_tokens:
            return self._emit_last()
        self.next_token = token

    def _emit(self, text: str) -> None:
        if text and self.on_text:
            self.on_text(text)

    def _emit_last(self) -> None:
        self._emit(self.stream.flush())
        self.next_token = None
        self.phase = Phase.DONE

    def fail(self, error: BaseException) -> None:
        """Stop stepping this request; the engine retires it with ``error``."""
        self.error, self.phase = error, Phase.DONE

    def finish(self, result: Generation | Prefilled | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.phase = result, error, Phase.DONE
        # what it referred to goes now, not at the next cyclic collection: a serving request's
        # callbacks hold its response sender, and Triton cannot unload the model while one lives
        self.on_text = self.on_progress = self.on_logits = self.backend = self.index = None
        self._done.set()

    def generation(self, kv) -> Generation:
        """The finished decode as a :class:`Generation`; ``kv`` the backend's :class:`KVStats`."""
        decode_s = time.perf_counter() - self.t_decode
        new = self.stream.token_ids
        backend = self.backend if self.decoder_ready else None
        probed = list(backend.layer_stats.values()) if backend else []  # per layer: (recall, cosine) per step
        if len({len(v) for v in probed}) > 1:
            raise RuntimeError(f"probed layers recorded different numbers of steps: {[len(v) for v in probed]}")
        return Generation(
            text=self.stream.text, token_ids=new, prompt_tokens=len(self.request.prompt_ids), new_tokens=len(new),
            finish_reason=self.finish_reason, prefill_s=self.prefill_s, decode_s=decode_s,
            tpot_s=decode_s / max(len(new) - 1, 1),  # n tokens take n-1 decode steps
            kv=kv, policy=self.request.plan.name,
            budget=self.request.plan.budget if self.request.plan.sparse else None,
            timings=dict(backend.timings) if backend else {},
            step_max_s=max(self.step_s, default=0.0), first_step_s=self.step_s[0] if self.step_s else 0.0,
            cached_tokens=self.cached_tokens, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            layer_stats={layer: {"recall": sum(r for r, _ in v) / len(v), "cosine": sum(c for _, c in v) / len(v)}
                         for layer, v in (backend.layer_stats.items() if backend else ())},
            step_recall=[sum(r for r, _ in step) / len(step) for step in zip(*probed)],  # step: each layer's pair
        )
