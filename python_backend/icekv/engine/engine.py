"""Runs requests on a model over the paged KV cache: chunked prefill, then token-by-token decode."""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Generator

import torch

from icekv.config import EngineConfig, SamplingConfig, SelectionConfig
from icekv.compress import CompressedContext, evict, make_compressor
from icekv.engine.compile_loops import compile_loops
from icekv.engine.compressed_attention import CompressedPrefixAttention, CompressedSparseAttention
from icekv.engine.full_attention import FullCacheAttention
from icekv.engine.index_build import IndexingPrefillAttention, PrefillIndex
from icekv.engine.sampling import sample_next
from icekv.engine.sparse_attention import SparseCacheAttention
from icekv.engine.text_stream import TextStream
from icekv.errors import CacheFullError, ConfigError
from icekv.kv import PagedKVCache
from icekv.model import Tokenizer, load_model
from icekv.select import make_selector

OnText = Callable[[str], None]
OnProgress = Callable[[int, int], None]
Steps = Generator[str, None, "Generation"]


def drain(steps: Generator, on_text: OnText | None = None):
    """Run engine steps to the end; returns their result, passing text pieces to ``on_text``."""
    while True:
        try:
            delta = next(steps)
        except StopIteration as done:
            return done.value
        if on_text and delta:
            on_text(delta)


@dataclass(frozen=True)
class KVStats:
    """KV cache of one request: bytes on the compute device vs in total (all layers), and traffic."""

    resident_bytes: int
    total_bytes: int
    pages: int
    bytes_moved: int = 0
    pages_moved: int = 0  # (layer, KV head) pages copied host -> device
    slot_hit_rate: float = 0.0
    index_bytes: int = 0  # host memory of the page index (IceCache trees, Quest bounds)


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prefill_s: float
    decode_s: float
    tpot_s: float
    kv: KVStats
    policy: str = "full"
    budget: int | None = None
    timings: dict = field(default_factory=dict)  # select_s, transfer_s, attention_s, index_build_s
    layer_stats: dict = field(default_factory=dict)  # probe: layer -> {"recall", "cosine"}
    step_max_s: float = 0.0  # the slowest decode step (a window flush inserts into every layer's index)
    first_step_s: float = 0.0  # the first decode step: caches cold after prefill, slots filled from empty

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prefilled:
    """A prompt whose KV is in the pool; decode it (possibly several times), then release it."""

    seq_id: int
    prompt_ids: list[int]
    logits: torch.Tensor  # [V] for the token after the prompt
    prefill_s: float
    context: CompressedContext | None = None  # a compressed context the prompt continues
    index: PrefillIndex | None = None  # a sparse policy's index built during prefill, for the first decode

    def prebuilt_index(self, selection: SelectionConfig) -> PrefillIndex | None:
        """The index prefill built, if it was built for ``selection`` and no decode has taken it."""
        return self.index if self.index is not None and self.index.selection == selection else None


def model_identity(model_dir: Path, dtype: str) -> str:
    """A stable id for stored artefacts: the config's hash, the weights' sizes and the dtype."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return f"{digest.hexdigest()[:24]}:{dtype}"


def resolve_model_dir(model_dir: str | None) -> Path:
    """The given directory, or the embedded default model (fetched on first use)."""
    if model_dir is not None:
        return Path(model_dir)
    from icekv.assets import Assets

    return Assets().model_dir()


class Engine:
    """One loaded model, its tokenizer and its KV pool; runs one request at a time."""

    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        free_cores = max((os.cpu_count() or 1) - torch.get_num_threads(), 0)
        self.index_threads = free_cores if config.index_threads is None else config.index_threads
        self.model_dir = resolve_model_dir(config.model_dir)
        self.model = load_model(self.model_dir, getattr(torch, config.dtype))
        self.tokenizer = Tokenizer(self.model_dir)
        args = self.model.args
        self.cache = PagedKVCache(
            args.num_layers, args.num_kv_heads, args.head_dim, config.paging, getattr(torch, config.dtype)
        )
        self._seq_ids = itertools.count()
        self.model_id = model_identity(self.model_dir, config.dtype)
        self._decoding: dict[int, object] = {}  # seq id -> its backend, when it reports resident_bytes()
        compile_loops(getattr(torch, config.dtype))  # here, not in the first request's first decode step

    def kv_bytes(self) -> tuple[int, int]:
        """(resident, host) KV bytes of all live requests: what the compute device holds (the full
        cache while prefilling or under full attention; sink, window, slots and unlimited layers
        under a budget) and what the page pool holds."""
        cache = self.cache
        host = (cache.allocator.num_pages - cache.allocator.num_free) * cache.bytes_per_page
        sparse = sum(b.resident_bytes() for b in self._decoding.values())
        dense = host - sum(cache.sequence_bytes(s) for s in self._decoding)
        return dense + sparse, host

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse up front a request the KV pool could never hold."""
        if prompt_tokens == 0:
            raise ConfigError("prompt is empty")
        capacity = self.cache.capacity_tokens
        if prompt_tokens + max_tokens > capacity:
            raise CacheFullError(
                f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the KV "
                f"cache capacity of {capacity} tokens (paging.max_context_tokens)"
            )

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingConfig = SamplingConfig(),
        on_text: OnText | None = None,
        on_progress: OnProgress | None = None,
        selection: SelectionConfig | None = None,
        context: CompressedContext | None = None,
    ) -> Generation:
        """Prefill ``prompt`` in chunks, then decode until EOS, a stop string or ``max_tokens``.

        With ``context``, the prompt continues a compressed context (e.g. a question about a
        document compressed once with :meth:`compress`)."""
        return drain(self.stream(prompt, sampling, selection, on_progress, context), on_text)

    def stream(
        self,
        prompt: str | list[int],
        sampling: SamplingConfig = SamplingConfig(),
        selection: SelectionConfig | None = None,
        on_progress: OnProgress | None = None,
        context: CompressedContext | None = None,
    ) -> Steps:
        """One request as a sequence of engine steps, for schedulers that interleave requests.

        Yields after every prefill chunk ('') and every decode step (the new text, maybe '');
        returns the :class:`Generation`. Closing the generator early (cancellation) frees the
        request's pages.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(len(ids), sampling.max_tokens)
        selection = selection or self.config.selection
        req = yield from self._prefill_steps(ids, on_progress, context, selection)
        try:
            return (yield from self._decode_steps(req, sampling, selection))
        finally:
            self.release(req)

    def prefill(self, ids: list[int], on_progress: OnProgress | None = None,
                selection: SelectionConfig | None = None) -> Prefilled:
        """Run the prompt through the model with full attention, ``prefill_chunk_tokens`` at a time.

        With a sparse ``selection`` and ``index_threads``, its index is built layer by layer
        meanwhile, for the first decode under that same selection (:mod:`icekv.engine.index_build`)."""
        return drain(self._prefill_steps(ids, on_progress, None, selection))

    def release(self, req: Prefilled) -> None:
        if req.index is not None:
            req.index.cancel()
        self.cache.free(req.seq_id)

    def decode(
        self,
        req: Prefilled,
        sampling: SamplingConfig = SamplingConfig(),
        selection: SelectionConfig | None = None,
        on_text: OnText | None = None,
        probe: bool = False,
    ) -> Generation:
        """Decode after a prefilled prompt under ``selection``; leaves the prompt's KV as it was,
        so the same prefill can be decoded again (e.g. under another policy)."""
        return drain(self._decode_steps(req, sampling, selection, probe), on_text)

    def _prefill_steps(self, ids: list[int], on_progress: OnProgress | None,
                       context: CompressedContext | None = None,
                       selection: SelectionConfig | None = None) -> Generator[str, None, Prefilled]:
        if not ids:
            raise ConfigError("prompt is empty")
        seq_id = next(self._seq_ids)
        self.cache.add(seq_id)
        index = None
        try:
            build = selection is not None and context is None and self.index_threads > 0
            selector = make_selector(selection) if build else None
            if selector is None:
                backend = self._dense_backend(seq_id, context)
            else:
                index = PrefillIndex(selection, selector, self.index_threads)
                backend = IndexingPrefillAttention(self.cache, seq_id, self.model.args.num_layers, len(ids), index)
            chunk = self.config.prefill_chunk_tokens
            t0 = time.perf_counter()
            for start in range(0, len(ids), chunk):
                tokens = torch.tensor(ids[start : start + chunk])  # [C]
                positions = backend.begin_step(len(tokens))
                logits = self.model(tokens, positions, backend, logit_rows=torch.tensor([-1]))  # [1, V]
                if on_progress:
                    on_progress(min(start + chunk, len(ids)), len(ids))
                yield ""
        except BaseException:  # errors and early close both give the pages back (and stop the index builds)
            if index is not None:
                index.cancel()
            self.cache.free(seq_id)
            raise
        return Prefilled(seq_id, list(ids), logits[-1], time.perf_counter() - t0, context, index)

    def _dense_backend(self, seq_id: int, context: CompressedContext | None):
        if context is None:
            return FullCacheAttention(self.cache, seq_id)
        if context.page_size != self.cache.page_size or len(context.layers) != self.model.args.num_layers:
            raise ConfigError("the compressed context was made for another model or page size")
        return CompressedPrefixAttention(self.cache, seq_id, context)

    def compress(self, context_ids: list[int], method: str, kv_budget: float, **settings) -> CompressedContext:
        """Prefill a context once, score it with ``method`` and keep ``kv_budget`` of its KV."""
        compressor = make_compressor(method, **settings)
        req = self.prefill(context_ids)
        try:
            scores = compressor.score(self, req.seq_id, list(context_ids), kv_budget)  # [L, Hkv, T]
            keep = evict(scores, kv_budget)
            return CompressedContext.from_cache(self.cache, req.seq_id, keep, method, kv_budget)
        finally:
            self.release(req)

    def _decode_steps(self, req, sampling, selection, probe=False) -> Steps:
        selection = selection or self.config.selection
        self.check_fits(len(req.prompt_ids), sampling.max_tokens)
        index = req.prebuilt_index(selection)
        if index is not None:  # a prefill-built index serves one decode under its selection: decoding changes it
            req.index = None
        selector = index.selector if index is not None else make_selector(selection)
        if req.context is not None and selection.policy not in ("full", "icecache"):
            # quest/streaming assume contiguous pages; icecache_r shares one token-to-page map across
            # layers, but compression keeps different tokens in each layer
            raise ConfigError(f"policy {selection.policy!r} cannot select over a compressed context; "
                              "use 'full' or 'icecache'")
        if selector is None:
            backend = self._dense_backend(req.seq_id, req.context)
        elif req.context is not None:
            backend = CompressedSparseAttention(self.cache, req.seq_id, self.model.args, selection, selector, req.context)
            self._decoding[req.seq_id] = backend
        else:  # builds the index: part of time to first token (timings["index_build_s"]), not of decode
            backend = SparseCacheAttention(self.cache, req.seq_id, self.model.args, selection, selector, probe,
                                           prebuilt=index.wait if index is not None else None)
            self._decoding[req.seq_id] = backend
        t0 = time.perf_counter()
        try:
            return (yield from self._decode_loop(req, backend, sampling, selection, t0))
        finally:
            self._decoding.pop(req.seq_id, None)
            self.cache.truncate(req.seq_id, len(req.prompt_ids))

    def _decode_loop(self, req, backend, sampling, selection, t0) -> Steps:
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stream = TextStream(self.tokenizer, sampling.stop)
        eos = set() if sampling.ignore_eos else set(self.model.args.eos_token_ids)
        logits, finish = req.logits, "length"
        step_s = []  # each decode step's wall time
        while True:
            token = sample_next(logits, sampling, generator)
            if token in eos:
                finish = "stop"
                break
            yield stream.push(token)
            if stream.stopped:
                finish = "stop"
                break
            if len(stream.token_ids) >= sampling.max_tokens:
                break
            t_step = time.perf_counter()
            positions = backend.begin_step(1)
            logits = self.model(torch.tensor([token]), positions, backend)[-1]  # [V]
            backend.end_step()
            step_s.append(time.perf_counter() - t_step)
        yield stream.flush()
        decode_s = time.perf_counter() - t0
        new = stream.token_ids
        total = self.cache.sequence_bytes(req.seq_id)
        sparse = isinstance(backend, SparseCacheAttention)
        compressed = isinstance(backend, (CompressedPrefixAttention, CompressedSparseAttention))
        kv = KVStats(
            resident_bytes=backend.resident_bytes() if sparse or compressed else total,
            total_bytes=total + (req.context.full_bytes if compressed else 0),
            pages=total // self.cache.bytes_per_page,
            **(backend.transfer_stats() if sparse else {}),
        )
        return Generation(
            text=stream.text,
            token_ids=new,
            prompt_tokens=len(req.prompt_ids),
            new_tokens=len(new),
            finish_reason=finish,
            prefill_s=req.prefill_s,
            decode_s=decode_s,
            tpot_s=decode_s / max(len(new) - 1, 1),  # n tokens take n-1 decode steps
            kv=kv,
            policy=selection.policy,
            budget=None if selection.policy == "full" else selection.budget,
            timings=dict(getattr(backend, "timings", {})),
            step_max_s=max(step_s, default=0.0),
            first_step_s=step_s[0] if step_s else 0.0,
            layer_stats={
                layer: {"recall": sum(r for r, _ in v) / len(v), "cosine": sum(c for _, c in v) / len(v)}
                for layer, v in (backend.layer_stats.items() if sparse else ())
            },
        )
