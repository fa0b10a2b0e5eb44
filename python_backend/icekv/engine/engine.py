"""Runs requests on a model over the paged KV cache: chunked prefill, then token-by-token decode."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from icekv.config import EngineConfig, SamplingConfig
from icekv.engine.full_attention import FullCacheAttention
from icekv.engine.sampling import sample_next
from icekv.engine.text_stream import TextStream
from icekv.errors import CacheFullError, ConfigError
from icekv.kv import PagedKVCache
from icekv.model import Tokenizer, load_model

OnText = Callable[[str], None]
OnProgress = Callable[[int, int], None]


@dataclass(frozen=True)
class KVStats:
    """Bytes of KV cache the request held on the compute device and in total (all layers)."""

    resident_bytes: int
    total_bytes: int
    pages: int


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

    def to_dict(self) -> dict:
        return asdict(self)


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
        self.model_dir = resolve_model_dir(config.model_dir)
        self.model = load_model(self.model_dir, getattr(torch, config.dtype))
        self.tokenizer = Tokenizer(self.model_dir)
        args = self.model.args
        self.cache = PagedKVCache(
            args.num_layers, args.num_kv_heads, args.head_dim, config.paging, getattr(torch, config.dtype)
        )
        self._seq_ids = itertools.count()

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
    ) -> Generation:
        """Prefill ``prompt`` in chunks, then decode until EOS, a stop string or ``max_tokens``."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(len(ids), sampling.max_tokens)
        seq_id = next(self._seq_ids)
        self.cache.add(seq_id)
        try:
            return self._run(seq_id, ids, sampling, on_text, on_progress)
        finally:
            self.cache.free(seq_id)

    def _run(self, seq_id, ids, sampling, on_text, on_progress) -> Generation:
        backend = FullCacheAttention(self.cache, seq_id)
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        chunk = self.config.prefill_chunk_tokens
        t0 = time.perf_counter()
        for start in range(0, len(ids), chunk):
            tokens = torch.tensor(ids[start : start + chunk])  # [C]
            positions = backend.begin_step(len(tokens))
            logits = self.model(tokens, positions, backend, logit_rows=torch.tensor([-1]))  # [1, V]
            if on_progress:
                on_progress(min(start + chunk, len(ids)), len(ids))
        prefill_s = time.perf_counter() - t0
        stream = TextStream(self.tokenizer, sampling.stop)
        eos = set() if sampling.ignore_eos else set(self.model.args.eos_token_ids)
        finish = "length"
        t1 = time.perf_counter()
        while True:
            token = sample_next(logits[-1], sampling, generator)
            if token in eos:
                finish = "stop"
                break
            delta = stream.push(token)
            if on_text and delta:
                on_text(delta)
            if stream.stopped:
                finish = "stop"
                break
            if len(stream.token_ids) >= sampling.max_tokens:
                break
            positions = backend.begin_step(1)
            logits = self.model(torch.tensor([token]), positions, backend)  # [1, V]
        tail = stream.flush()
        if on_text and tail:
            on_text(tail)
        decode_s = time.perf_counter() - t1
        new = stream.token_ids
        total = self.cache.sequence_bytes(seq_id)
        return Generation(
            text=stream.text,
            token_ids=new,
            prompt_tokens=len(ids),
            new_tokens=len(new),
            finish_reason=finish,
            prefill_s=prefill_s,
            decode_s=decode_s,
            tpot_s=decode_s / max(len(new) - 1, 1),  # n tokens take n-1 decode steps
            kv=KVStats(resident_bytes=total, total_bytes=total, pages=total // self.cache.bytes_per_page),
        )
