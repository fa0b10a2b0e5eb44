"""The reusable-context evaluation: compress each context once, then ask all its questions.

The full-cache row is the same pipeline at a 100% budget (bit-identical to full attention, see
the tests), so every method is measured through the same code path.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import psutil

from icekv.config import SamplingConfig
from icekv.engine import Engine
from icekv.errors import ConfigError
from icekv.compress import COMPRESSORS
from icekv.eval.tasks import HaystackSampler, PromptFormat, make_reusable


@dataclass(frozen=True)
class CompressionEvalConfig:
    methods: tuple[str, ...] = ("kv2", "kvzip")
    kv_budgets: tuple[float, ...] = (0.05,)
    haystack: str = "essays"
    lengths: tuple[int, ...] = (2000,)
    samples: int = 5
    questions: int = 4
    seed: int = 0
    max_tokens: int = 12
    settings: tuple[tuple[str, dict], ...] = ()  # per-method settings, e.g. (("kv2", {"rho": 0.25}),)
    chat_template: bool = False  # the context and each question inside one user turn of the chat template

    def __post_init__(self) -> None:
        for m in self.methods:
            if m not in COMPRESSORS:
                raise ConfigError(f"--compress: unknown method {m!r}; choose from {', '.join(COMPRESSORS)}")
        for b in self.kv_budgets:
            if not (0 < b <= 1):
                raise ConfigError(f"--kv-budgets: {b} is not in (0, 1]")


class PeakRSS:
    """Peak resident memory growth of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> "PeakRSS":
        self._proc = psutil.Process()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


def run_compression_eval(engine: Engine, cfg: CompressionEvalConfig, haystack_text: str,
                         progress: Callable[[int, int], None] | None = None) -> list[dict]:
    sampler = HaystackSampler(haystack_text, engine.tokenizer)
    form = PromptFormat.from_chat_template(engine.chat_prompt) if cfg.chat_template else PromptFormat()
    settings = dict(cfg.settings)
    runs = [("full", 1.0)] + [(m, b) for m in cfg.methods for b in cfg.kv_budgets]
    sampling = SamplingConfig(max_tokens=cfg.max_tokens, stop=("\n",))
    acc: dict[tuple, list] = defaultdict(list)
    total, done = len(cfg.lengths) * cfg.samples * len(runs), 0
    for length in cfg.lengths:
        for i in range(cfg.samples):
            seed = zlib.crc32(f"{cfg.seed}/{cfg.haystack}/reuse/{length}/{i}".encode())
            sample = make_reusable(sampler, length, seed, cfg.questions)
            ids = engine.tokenizer.encode(form.context(sample.context))
            for method, budget in runs:
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    ctx = engine.compress(ids, "streaming" if method == "full" else method, budget,
                                          **settings.get(method, {}))
                    compress_s = time.perf_counter() - t0
                scores = []
                for question, answer in sample.questions:
                    out = engine.generate(engine.tokenizer.encode(form.question(question)), sampling, context=ctx)
                    scores.append(float(answer in out.text))
                acc[(length, method, budget)].append((scores, compress_s, mem.growth, ctx.kv_bytes, ctx.full_bytes))
                done += 1
                if progress:
                    progress(done, total)
    records = []
    for (length, method, budget), rs in acc.items():
        scores = [s for r in rs for s in r[0]]
        mean = lambda i: sum(r[i] for r in rs) / len(rs)
        records.append({
            "task": "niah_multikey_reuse", "haystack": cfg.haystack, "length": length, "method": method,
            "kv_budget": budget, "accuracy": sum(scores) / len(scores), "n": len(scores),
            "contexts": len(rs), "questions_per_context": cfg.questions, "compress_s": mean(1),
            "peak_memory_growth_bytes": max(r[2] for r in rs), "kv_bytes": mean(3), "full_kv_bytes": mean(4),
            "settings": settings.get(method, {}), "chat_template": cfg.chat_template,
        })
    return records
