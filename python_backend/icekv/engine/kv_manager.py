"""What a request may hold, and whether it fits: the engine's KV-cache manager.

At submit a request is charged its worst case (:class:`Admission`): KV pages for prompt +
max_tokens, its policy's page index in host memory, its compressed context's bytes and, with the
pool off the compute device, the device memory it holds beside the model. The scheduler asks
:meth:`KVCacheManager.can_allocate` whether a waiting request fits beside what the running ones
were promised, and never reads the allocator (as vLLM's and nano-vllm's schedulers ask their
block or KV-cache manager); :meth:`free` hands a finished request's pages and index back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from icekv.config.engine import SchedulerConfig
from icekv.errors import IcekvError
from icekv.kv import PagedKVCache
from icekv.model import ModelArgs
from icekv.policies.index_cache import IndexCache
from icekv.sizing import DeviceNeed, device_need

MIB = 2**20


@dataclass(frozen=True)
class Admission:
    """A request's worst case, charged from admission until it finishes."""

    pages: int = 0  # KV pages of its own: prompt + max_tokens
    index_bytes: int = 0  # host memory of its page index
    context_bytes: int = 0  # its compressed context (held once however many requests share it)
    device_need: DeviceNeed = DeviceNeed(0, 0)  # only while the pool is off the compute device


class KVCacheManager:
    """The pool's pages and the memory budgets beside it (:class:`icekv.config.engine.SchedulerConfig`):
    ``max_index_bytes`` and ``max_context_bytes`` default to the pool's size in the model's dtype
    (so a quantized ``kv_dtype`` shrinks the pool, not what may be indexed); ``device_limit`` None
    where device memory is not charged (the pool is on the compute device, allocated whole)."""

    def __init__(self, cache: PagedKVCache, args: ModelArgs, cfg: SchedulerConfig, device_limit: int | None,
                 device_type: str, chunk_tokens: int, indexes: IndexCache | None = None):
        self.cache, self.args, self.device_type = cache, args, device_type
        self.chunk_tokens = chunk_tokens  # the most prompt tokens of one request a step
        self.indexes = indexes  # finished requests' indexes, kept under index_limit beside the running ones
        pool_bytes = cache.capacity_tokens * cache.value_bytes_per_token
        self.index_limit = pool_bytes if cfg.max_index_bytes is None else cfg.max_index_bytes
        self.context_limit = pool_bytes if cfg.max_context_bytes is None else cfg.max_context_bytes
        self.device_limit = device_limit

    def admission(self, seq) -> Admission:
        """The worst case of ``seq``'s request; IcekvError when it could never fit."""
        r = seq.request
        prompt_tokens, max_tokens, context = len(r.prompt_ids), r.sampling.max_tokens, r.context
        held = prompt_tokens + (0 if r.prefill_only else max_tokens)
        index = 0
        if seq.selects and not r.prefill_only:
            kept = math.ceil(context.kv_budget * context.length) if context is not None else 0
            index = r.plan.index_bytes(self.args, held + kept, self.cache.dtype)
        context_bytes = context.nbytes if context is not None else 0
        device = DeviceNeed(0, 0)
        if not self.cache.pool_on_compute:
            layer_token_bytes = self.cache.value_bytes_per_token // self.args.num_layers  # a bound when quantized
            device = device_need(self.args, prompt_tokens, max_tokens, None if r.prefill_only else r.plan,
                                 layer_token_bytes, context_bytes, self.device_type,
                                 chunk_tokens=self.chunk_tokens)
        charge = Admission(math.ceil(held / self.cache.page_size), index, context_bytes, device)
        self._check(charge, r.plan.name)
        return charge

    def _check(self, charge: Admission, policy: str) -> None:
        if charge.index_bytes > self.index_limit:
            raise IcekvError(
                f"policy {policy} needs a page index of ~{charge.index_bytes / MIB:.0f} MiB for this request, above "
                f"max_index_bytes ({self.index_limit / MIB:.0f} MiB): shorten the prompt or max_tokens, or use a "
                f"smaller index (icecache_r, quest) or none (streaming, full)")
        if charge.context_bytes > self.context_limit:
            raise IcekvError(f"the compressed context takes {charge.context_bytes / MIB:.0f} MiB, above "
                             f"max_context_bytes ({self.context_limit / MIB:.0f} MiB)")
        if self.device_limit is not None and charge.device_need.most > self.device_limit:
            remedy = ", or compress it as a context" if self.args.takes_contexts else ""
            local = ", a local layer's about its window" if self.args.local_layers else ""
            raise IcekvError(
                f"this request needs ~{charge.device_need.most / MIB:,.0f} MiB of device memory (its prefill keeps "
                f"the prompt's K/V there{local}), above max_device_bytes ({self.device_limit / MIB:,.0f} MiB): "
                f"shorten the prompt{remedy}")

    def can_allocate(self, seq, running) -> bool:
        """Does ``seq``'s worst case fit beside what the ``running`` requests were promised?"""
        promised = sum(self._pages_to_come(s) for s in running)
        index = self.index_promised(running) + seq.admission.index_bytes
        contexts = {id(s.request.context): s.admission.context_bytes  # a shared context is held once
                    for s in [*running, seq] if s.request.context is not None}
        return (promised + self._pages_to_come(seq) <= self.cache.pages_available
                and index <= self.index_limit and sum(contexts.values()) <= self.context_limit
                and (self.device_limit is None
                     or self.device_promised(running) + seq.admission.device_need.most <= self.device_limit))

    def allocate(self, seq, running) -> None:
        """``seq`` is admitted beside ``running``: kept indexes make room for the indexes they may build."""
        if self.indexes is not None:
            self.indexes.trim(self.index_limit - self.index_promised([*running, seq]))

    @staticmethod
    def device_promised(running) -> int:
        """Device bytes the ``running`` requests may hold: a prefill's prefill or decode, whichever
        is more, a decode's decode."""
        return sum(s.admission.device_need.decode if s.decoding else s.admission.device_need.most for s in running)

    @staticmethod
    def index_promised(running) -> int:
        """Host bytes of page index the ``running`` requests may build."""
        return sum(s.admission.index_bytes for s in running)

    def _pages_to_come(self, seq) -> int:
        """Pages ``seq`` may still allocate: its worst case less what it holds."""
        return max(seq.admission.pages - self.cache.pages_held(seq.seq_id), 0)

    def free(self, seq, keep_tokens: int | None = None) -> None:
        """Hand back what ``seq`` holds: its index's builds and its pages (the prefix cache keeps
        what it may of them), or with ``keep_tokens`` only the pages past them (a decode over a
        prefilled prompt leaves the prompt as it was)."""
        if keep_tokens is not None:
            self.cache.truncate(seq.seq_id, keep_tokens)
            return
        if seq.index is not None:
            seq.index.cancel()
        self._keep_index(seq)
        if self.cache.has(seq.seq_id):  # none before its prefill started
            self.cache.free(seq.seq_id, seq.tokens_to_cache(), seq.request.caching.retention_s)

    def _keep_index(self, seq) -> None:
        """A finished decode's index, kept for a request that continues its tokens."""
        r, backend = seq.request, seq.backend
        if self.indexes is None or seq.error is not None or not seq.decoder_ready or not seq.shares_index:
            return
        self.indexes.keep(r.prompt_ids + seq.stream.token_ids, backend.win_start, r.plan, backend.selector)
        self.indexes.trim(self.index_limit)
