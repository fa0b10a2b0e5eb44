"""The engine: one loaded model, its tokenizer and KV pool, and the public API over its steps.

Every request, a single ``generate`` call as much as a server's many, is a :class:`Sequence`
submitted to the scheduler; :meth:`Engine.step` runs one step over every running sequence
(continuous batching). One thread steps the engine; any thread may submit or cancel.
"""

from __future__ import annotations

import itertools
import os
from typing import Generator

import torch

from icekv.compress import CompressedContext
from icekv.config.engine import EngineConfig
from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.devices import pool_device, resolve_device
from icekv.engine.compile_loops import compile_loops
from icekv.engine.compression import CompressionJob
from icekv.engine.backends import DenseAttention, check_contexts_allowed, token_source
from icekv.engine.grammar import Grammars
from icekv.engine.kv_manager import KVCacheManager
from icekv.engine.model_dir import model_identity, resolve_model_dir
from icekv.engine.results import Generation, Prefilled
from icekv.engine.scheduler import Scheduler
from icekv.engine.sequence import OnLogits, OnProgress, OnText, Phase, Request, Sequence
from icekv.engine.step import StepRunner
from icekv.errors import CacheFullError, ConfigError
from icekv.kv import PagedKVCache, PrefixCache
from icekv.kv.quant import KVFormat
from icekv.model import ByteTokenizer, Tokenizer, load_model, random_model
from icekv.model.gguf_blocks import load_int4_blocks
from icekv.model.weights import store_weights, stored_apart
from icekv.chat_template import ChatTemplate, require_template
from icekv.policies import PolicyPlan, resolve
from icekv.policies.index_cache import IndexCache

FULL = SelectionConfig(policy="full")  # a prefill's attention, unless a request names the decode it prepares
DEVICE_SHARE = 0.9  # of the device memory free once loaded, for requests (the rest: a step's activations)


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self.plan = resolve(config.selection)  # the default plan: what a request naming none runs under
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        free_cores = max((os.cpu_count() or 1) - torch.get_num_threads(), 0)
        self.index_threads = free_cores if config.index_threads is None else config.index_threads
        self.device = resolve_device(config.device)
        dtype_name = config.dtype_on(self.device.type)
        dtype = getattr(torch, dtype_name)
        self.weights = config.weights_on(self.device.type)  # how the linear weights are stored
        from_gguf = False  # int4 codes taken from the checkpoint's GGUF blocks
        if config.random_weights is not None:
            self.model_dir, self.model_name = None, f"random {config.random_weights}"
            self.model = random_model(config.random_weights, dtype, self.device, weights=self.weights)
            self.tokenizer, self.chat_template = ByteTokenizer(), None
            self.model_id = f"random:{config.random_weights}:{dtype_name}"
        else:
            self.model_dir = resolve_model_dir(config.model_dir)
            self.model_name = str(self.model_dir)
            self.model = load_model(self.model_dir, dtype, config.allow_extra_weights).to(self.device)
            self.tokenizer = Tokenizer(self.model_dir)
            self.chat_template = ChatTemplate.load(self.model_dir)
            self.model_id = model_identity(self.model_dir, dtype_name)
            int4_codes = load_int4_blocks(self.model_dir) if self.weights == "int4" else {}
            from_gguf = bool(int4_codes)
            store_weights(self.model, self.weights, dtype, int4_codes)  # consumes int4_codes
        if stored_apart(self.weights, dtype_name):  # stored KV (prefix pages, compressed contexts) differs per format
            self.model_id += f":weights-{self.weights}" + ("-gguf" if from_gguf else "")
        if config.paging.kv_dtype != "auto":  # stored KV (prefix pages, compressed contexts) differs per format
            self.model_id += f":kv-{config.paging.kv_dtype}"
        args = self.model.args
        self.plan.check_model(args)
        pool = pool_device(config.pool_placement(self.plan.sparse), self.device)
        prefix = PrefixCache(self.model_id, config.paging.page_size) if config.paging.prefix_cache else None
        self.cache = PagedKVCache(args.num_layers, args.num_kv_heads, args.head_dim, config.paging, dtype,
                                  device=pool, compute=self.device, prefix=prefix,
                                  kv_format=KVFormat(config.paging.kv_dtype), layer_windows=args.layer_windows)
        indexes = IndexCache(self.model_id, config.paging.page_size) if config.paging.prefix_cache else None
        self.kv = KVCacheManager(self.cache, args, config.scheduler, self._device_limit(), self.device.type,
                                 config.prefill_chunk_tokens, indexes)
        self.scheduler = Scheduler(config.scheduler, self.kv, config.prefill_chunk_tokens)
        self.runner = StepRunner(self.model, self.tokenizer, self.cache, self.index_threads,
                                 config.prefill_chunk_tokens, config.search_threads, indexes)
        self.grammars = Grammars(self.tokenizer.to_json(), list(args.eos_token_ids))
        self._seq_ids = itertools.count()
        compile_loops(dtype, self.cache.kv_format)  # here, not in the first request's first decode step

    def _device_limit(self) -> int | None:
        """Device bytes requests may hold beside the model; None where they are not charged (the
        pool is on the compute device, allocated whole)."""
        if self.cache.pool_on_compute:
            return None
        if self.config.scheduler.max_device_bytes is not None:
            return self.config.scheduler.max_device_bytes
        if self.device.type != "cuda":
            return None  # no free-memory reading to default to
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(DEVICE_SHARE * free)

    # ---- requests
    def chat_prompt(self, messages, tools=None, tools_optional: bool = False) -> str:
        """OpenAI-style ``messages`` (and the ``tools`` offered) as the prompt text of this model's
        chat template; ChatTemplateError if it has none, or if it cannot show tools that are not
        ``tools_optional`` (ChatTemplate.render)."""
        return require_template(self.chat_template, self.model_name).render(messages, tools,
                                                                            tools_optional=tools_optional)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse up front a request the KV pool could never hold."""
        if prompt_tokens == 0:
            raise ConfigError("prompt is empty")
        capacity = self.cache.capacity_tokens
        if prompt_tokens + max_tokens > capacity:
            raise CacheFullError(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the KV "
                f"cache capacity of {capacity} tokens (paging.pool_tokens)"
            )

    def plan_for(self, selection: SelectionConfig | PolicyPlan | None) -> PolicyPlan:
        """A request's plan: the engine's own for None, a resolved one as is, else ``selection``
        resolved (ConfigError for a policy unknown or without room in its budget)."""
        if selection is None:
            return self.plan
        return selection if isinstance(selection, PolicyPlan) else resolve(selection)

    def check_request(self, prompt_tokens: int, max_tokens: int, selection: SelectionConfig | PolicyPlan | None,
                      context_tokens: int | None) -> PolicyPlan:
        """The request's plan (:meth:`plan_for`); refuses up front a request that could never run:
        empty, too long for the pool, a policy unknown, without room in its budget or unable to run
        on this model, or one that cannot select over a compressed context (of ``context_tokens``;
        None: the request has none)."""
        self.check_fits(prompt_tokens, max_tokens)
        if context_tokens is not None:
            check_contexts_allowed(self.model.args)
        plan = self.plan_for(selection)
        plan.check_model(self.model.args)
        if context_tokens is not None and not plan.compressed_context:
            raise ConfigError(f"policy {plan.name!r} cannot select over a compressed context; use 'full' or 'icecache'")
        return plan

    def submit(self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(),
               selection: SelectionConfig | PolicyPlan | None = None, context: CompressedContext | None = None,
               on_text: OnText | None = None, on_progress: OnProgress | None = None, *,
               caching: PromptCaching = PromptCaching()) -> Sequence:
        """Queue a request; it runs as :meth:`step` is called. Raises IcekvError for a request that
        could never run (empty, too long, a policy that cannot take its context) or BusyError.
        ``caching``: whether the prefix cache serves its prompt and keeps its pages, and for how long."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._submit(ids, sampling, selection, context, on_text, on_progress, caching=caching)

    def submit_decode(self, req: Prefilled, sampling: SamplingConfig = SamplingConfig(),
                      selection: SelectionConfig | PolicyPlan | None = None, suffix: list[int] = (),
                      on_text: OnText | None = None, probe: bool = False,
                      on_logits: OnLogits | None = None) -> Sequence:
        """Queue a decode over a prefilled prompt (:meth:`decode`'s), after prefilling ``suffix``
        over it; ``probe``: measure attention recall at each decode step; ``on_logits``: sees each
        step's logits before its token is picked."""
        return self._submit(req.prompt_ids + list(suffix), sampling, selection, req.context, on_text, None,
                            on_logits, prefilled=req, probe=probe)

    def submit_prefill(self, ids: list[int], selection: SelectionConfig | PolicyPlan | None = None,
                       on_progress: OnProgress | None = None, *,
                       caching: PromptCaching = PromptCaching(enabled=False)) -> Sequence:
        """Queue a prefill-only request (:meth:`prefill`'s); its result is a :class:`Prefilled`.
        ``caching``: off unless asked, for a prefill whose caller reads every token's pass (a
        compression's scoring); a prefill under full attention may take and keep cached pages."""
        return self._submit(list(ids), SamplingConfig(max_tokens=1), selection or FULL, None, None, on_progress,
                            prefill_only=True, caching=caching)

    def _submit(self, ids: list[int], sampling: SamplingConfig, selection: SelectionConfig | PolicyPlan | None,
                context: CompressedContext | None, on_text: OnText | None, on_progress: OnProgress | None,
                on_logits: OnLogits | None = None, **kind) -> Sequence:
        """The one way in: the request checked, charged its worst case, queued. ``kind``: the
        :class:`Request` fields that make it a decode over a prefilled prompt, a prefill only, a
        probed decode, or set its prompt caching."""
        vocab = self.model.args.vocab_size
        named_tokens = (("logit_bias", [t for t, _ in sampling.logit_bias]), ("forced_tokens", sampling.forced_tokens))
        for name, named in named_tokens:
            if (largest := max(named, default=-1)) >= vocab:
                raise ConfigError(f"{name} names token {largest}; this model's vocabulary has {vocab} tokens")
        plan = self.check_request(len(ids), sampling.max_tokens, selection, None if context is None else context.length)
        prefilled = kind.get("prefilled")
        seq_id = prefilled.seq_id if prefilled is not None else next(self._seq_ids)
        seq = Sequence(seq_id, Request(ids, sampling, plan, context, **kind), on_text, on_progress, on_logits)
        seq.grammar = self.grammars.for_request(sampling)
        if prefilled is not None:  # its prompt continues the prefilled one (submit_decode)
            seq.prefill_done = len(prefilled.prompt_ids)
        seq.admission = self.kv.admission(seq)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Run one step over the running requests; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        for seq, why in out.dropped:
            seq.fail(why)
        self.runner.run(out.work)
        finished = [seq for seq, _ in out.dropped] + [seq for seq, _ in out.work if seq.phase is Phase.DONE]
        for seq in finished:
            self.scheduler.remove(seq)
            self._retire(seq)
        return finished

    def run(self, seq: Sequence) -> Generation | Prefilled:
        """Step until ``seq`` is done; its result, or its error raised."""
        while not seq.done:
            self.step()
        if seq.error is not None:
            raise seq.error
        return seq.result

    def _retire(self, seq: Sequence) -> None:
        """Hand back what a finished request holds; its result (or error) becomes visible."""
        result, r = None, seq.request
        try:
            if seq.error is None and r.prefill_only:
                result = Prefilled(seq.seq_id, r.prompt_ids, seq.logits, seq.prefill_s, r.context, seq.index,
                                   seq.window_queries, seq.cached_tokens)
            elif seq.error is None:
                backend = seq.backend or DenseAttention(token_source(self.cache, seq.seq_id, r.context))
                kv = backend.kv_stats()
                result = seq.generation(kv)
        except Exception as e:
            seq.error = e
        finally:
            if r.prefilled is not None:  # leave the prompt's KV as it was, for the next decode
                self.kv.free(seq, keep_tokens=len(r.prefilled.prompt_ids))
            elif seq.error is not None or not r.prefill_only:
                self.kv.free(seq)
            seq.finish(result, seq.error)

    # ---- the public API (each call a batch of one unless something else is running)
    def generate(self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(),
                 on_text: OnText | None = None, on_progress: OnProgress | None = None,
                 selection: SelectionConfig | PolicyPlan | None = None, context: CompressedContext | None = None) -> Generation:
        """Prefill ``prompt``, then decode until EOS, a stop string or ``max_tokens``. With
        ``context``, the prompt continues a compressed context (made once with :meth:`compress`)."""
        return self.run(self.submit(prompt, sampling, selection, context, on_text, on_progress))

    def stream(self, prompt: str | list[int], sampling: SamplingConfig = SamplingConfig(),
               selection: SelectionConfig | PolicyPlan | None = None, on_progress: OnProgress | None = None,
               context: CompressedContext | None = None) -> Generator[str, None, Generation]:
        """:meth:`generate` as a generator of text pieces (one yield per step, '' when none);
        returns the :class:`Generation`. Closing it early cancels the request."""
        pieces: list[str] = []
        seq = self.submit(prompt, sampling, selection, context, pieces.append, on_progress)
        try:
            while not seq.done:
                self.step()
                yield "".join(pieces)
                pieces.clear()
        finally:
            seq.cancel()  # a no-op once done
            while not seq.done:
                self.step()
        if seq.error is not None:
            raise seq.error
        return seq.result

    def prefill(self, ids: list[int], on_progress: OnProgress | None = None,
                selection: SelectionConfig | PolicyPlan | None = None, *,
                caching: PromptCaching = PromptCaching(enabled=False)) -> Prefilled:
        """Run the prompt through the model and keep its KV, to decode later (maybe several times).
        With a sparse ``selection`` and free index threads, its index is built meanwhile, for the
        first decode under that same selection (:mod:`icekv.engine.backends.prefill_index`).
        ``caching``: as :meth:`submit_prefill`'s."""
        return self.run(self.submit_prefill(ids, selection, on_progress, caching=caching))

    def decode(self, req: Prefilled, sampling: SamplingConfig = SamplingConfig(),
               selection: SelectionConfig | PolicyPlan | None = None, on_text: OnText | None = None,
               probe: bool = False, suffix: list[int] = (), on_logits: OnLogits | None = None) -> Generation:
        """Decode after a prefilled prompt under ``selection``, after prefilling ``suffix`` over it
        (a question asked of a prefilled context); leaves the prompt's KV as it was."""
        return self.run(self.submit_decode(req, sampling, selection, suffix, on_text, probe, on_logits))

    def release(self, req: Prefilled) -> None:
        if req.index is not None:
            req.index.cancel()
        self.cache.free(req.seq_id)

    def compress(self, context_ids: list[int], method: str, kv_budget: float, **settings) -> CompressedContext:
        """Prefill a context once, score it with ``method`` and keep ``kv_budget`` of its KV."""
        job = CompressionJob(self, context_ids, method, kv_budget, **settings)
        while not job.done:
            if job.scoring:
                job.advance()
            else:
                self.step()
        if job.error is not None:
            raise job.error
        return job.result

    # ---- statistics
    def kv_bytes(self) -> tuple[int, int]:
        """(resident, host) KV bytes of all live requests: what the compute device holds (the full
        cache while prefilling or under full attention; sink, window, slots and unlimited layers
        under a budget) and what the page pool holds for them (a shared cached page once; idle
        cached pages are the prefix cache's, not theirs)."""
        cache = self.cache
        host = (cache.allocator.num_pages - cache.pages_available) * cache.bytes_per_page
        decoding = [s for s in self.scheduler.running if s.decoder_ready]
        sparse = sum(s.backend.kv_stats().resident_bytes for s in decoding)
        dense = host - cache.held_bytes(s.seq_id for s in decoding)
        return dense + sparse, host
