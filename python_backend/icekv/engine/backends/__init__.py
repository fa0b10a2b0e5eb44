"""Attention backends, composed from a token source (:mod:`.sources`: the request's pages, or a
compressed context then its pages) and how they attend (:mod:`.dense`, :mod:`.sparse`); and which
one a request runs under, in prefill and in decode: the one place that decides it.

Prefill always attends the whole prompt; where index threads are free, a sparse policy's index is
built meanwhile. Decode runs under the request's policy.
"""

from __future__ import annotations

from icekv.compress import CompressedContext
from icekv.engine.backends.dense import DenseAttention
from icekv.engine.backends.sources import ContextPages, RequestPages, token_source
from icekv.engine.backends.sampled import SampledAttention
from icekv.engine.backends.sparse import SparseAttention
from icekv.engine.backends.prefill_index import IndexingPrefillAttention, PrefillIndex
from icekv.engine.sequence import Sequence
from icekv.errors import ConfigError
from icekv.kv import PagedKVCache
from icekv.model import ModelArgs
from icekv.policies.index_cache import IndexCache


def check_contexts_allowed(args: ModelArgs) -> None:
    """ConfigError for a model that cannot attend a compressed context (:attr:`ModelArgs.takes_contexts`)."""
    if not args.takes_contexts:
        raise ConfigError(f"compressed contexts are not supported for a model with sliding-window layers "
                          f"({len(args.local_layers)} of {args.num_layers} attend {args.sliding_window} tokens)")


def check_context(context: CompressedContext, cache: PagedKVCache, args: ModelArgs) -> None:
    check_contexts_allowed(args)
    if context.page_size != cache.page_size or len(context.layers) != args.num_layers:
        raise ConfigError("the compressed context was made for another model or page size")
    if context.kv_dtype != cache.kv_format.name:
        raise ConfigError(f"the compressed context stores kv_dtype {context.kv_dtype}, this engine "
                          f"{cache.kv_format.name}")


def _continued_index(seq: Sequence, indexes: IndexCache | None, take: bool):
    """A finished request's index that ``seq``'s decode may continue (``take``: the
    :class:`KeptIndex`, now ``seq``'s; else its key), or None: it builds its own."""
    r = seq.request
    if indexes is None or not seq.shares_index:
        return None
    most = r.plan.window_start(r.plan.sink_tokens, len(r.prompt_ids))
    if take:
        return indexes.take(r.prompt_ids, most, r.plan)
    return indexes.find(r.prompt_ids, most, r.plan)


def prefill_backend(cache: PagedKVCache, seq: Sequence, args: ModelArgs, index_threads: int,
                    chunk_tokens: int, indexes: IndexCache | None = None):
    """Full attention over the prompt, ``chunk_tokens`` at most a step; with free index threads, a
    sparse policy's index is built layer by layer meanwhile (``seq.index``), for the first decode
    under that same plan, unless the decode can continue a kept index (``indexes``)."""
    r = seq.request
    # a prefill for later decodes (prefill_only) cannot know their length: it assumes they select
    selects = seq.selects or (r.plan.sparse and r.prefill_only)
    # an index built here would miss the tokens already cached (a prefilled prompt's suffix), and
    # one built from the prompt's last queries waits for them
    if (r.context is not None or not selects or index_threads == 0 or r.prefilled is not None
            or r.plan.window_queries or _continued_index(seq, indexes, take=False)):
        backend = DenseAttention(token_source(cache, seq.seq_id, r.context, len(r.prompt_ids), chunk_tokens))
    else:
        seq.index = PrefillIndex(r.plan, r.plan.make_selector(), index_threads, cache.compute)
        backend = IndexingPrefillAttention(cache, seq.seq_id, args, len(r.prompt_ids), chunk_tokens, seq.index)
    backend.keep_queries = r.plan.window_queries_kept(r.prefill_only)
    if backend.keep_queries and r.prefilled is not None:  # the window may reach back into the prefilled prompt
        backend.kept_queries = dict(r.prefilled.window_queries or {})
    return backend


def decode_backend(cache: PagedKVCache, seq: Sequence, args: ModelArgs, indexes: IndexCache | None = None):
    """The backend for the request's decode steps under its policy (a sparse one builds its index
    here, takes the one prefill built for this plan, or continues a kept one)."""
    r = seq.request
    plan, prefilled = r.plan, r.prefilled
    index = seq.index if prefilled is None else prefilled.prebuilt_index(plan)  # built for this plan
    if prefilled is not None and len(r.prompt_ids) > len(prefilled.prompt_ids):
        index = None  # it lacks the suffix: this decode builds its own (prefilled keeps it for another)
    if prefilled is not None and index is not None:
        prefilled.index = None  # decoding changes the index: it serves this one decode
    seq.index = None
    source = token_source(cache, seq.seq_id, r.context, seq.tokens_held)
    if not seq.selects:
        if index is not None:
            index.cancel()
        return DenseAttention(source)
    kept = _continued_index(seq, indexes, take=True) if index is None else None
    selector = (index or kept).selector if index or kept else plan.make_selector()
    queries = seq.window_queries or (prefilled.window_queries if prefilled is not None else None)
    backend = SampledAttention if plan.sampled else SparseAttention
    return backend(source, args, plan, selector, r.probe,
                   prebuilt=index.wait if index is not None else None, window_queries=queries,
                   indexed_until=kept.covered if kept is not None else None)


__all__ = ["ContextPages", "DenseAttention", "RequestPages", "SampledAttention", "SparseAttention", "check_context",
           "check_contexts_allowed", "decode_backend",
           "prefill_backend", "token_source"]
