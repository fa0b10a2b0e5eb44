"""The reusable-context evaluation: compress each context once, then ask all its questions.

Each context is prefilled once; every variant (a method with its settings) then scores that same
prefilled cache and keeps each budget's share of it, so a variant's cost is measured beyond the
prefill it shares with the others. Scores that do not depend on the budget are computed once per
variant. The full-cache row keeps everything (bit-identical to full attention, see the tests), so
every row goes through the same code path.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from icekv.compress import CompressedContext, evict, make_compressor
from icekv.compress.scoring import run_steps
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.config.serving import check_kv_budget
from icekv.engine import Engine
from icekv.engine.backends import check_contexts_allowed
from icekv.engine.compression import scoring_context
from icekv.errors import ConfigError
from icekv.eval.run_log import ContextGrid, RunLog, context_key, grid_of
from icekv.eval.stats import wilson_interval
from icekv.eval.tasks import REUSABLE_TASKS, HaystackSampler, PromptFormat, make_reusable
from icekv.policies import resolve

FULL = "full"


@dataclass(frozen=True)
class Variant:
    """One row family of the table: ``method`` run with ``settings``, reported as ``label``."""

    label: str
    method: str
    settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        make_compressor(self.method, **self.settings)  # ConfigError now, not after the first prefill


@dataclass(frozen=True)
class CompressionEvalConfig(ContextGrid):
    variants: tuple[Variant, ...] = (Variant("kv2", "kv2"), Variant("kvzip", "kvzip"))
    kv_budgets: tuple[float, ...] = (0.05,)
    tasks: tuple[str, ...] = ("niah_multikey",)
    haystack: str = "essays"
    lengths: tuple[int, ...] = (2000,)
    samples: int = 5  # contexts per task and length
    questions: int = 4  # per niah_multikey context (niah_single asks one)
    seed: int = 0
    max_tokens: int = 12
    chat_template: bool = False  # the context and each question inside one user turn of the chat template

    def __post_init__(self) -> None:
        for b in self.kv_budgets:
            check_kv_budget(b, "--kv-budgets")
        for t in self.tasks:
            if t not in REUSABLE_TASKS:
                raise ConfigError(f"--task: {t!r} cannot be asked as a reusable context; choose from "
                                  f"{', '.join(REUSABLE_TASKS)}")
        if len({v.label for v in self.variants}) != len(self.variants) or FULL in {v.label for v in self.variants}:
            raise ConfigError(f"variant labels must be unique and not {FULL!r}")


def _release_free_memory() -> None:
    """Hand the allocator's free memory back to the system (glibc), so that what one measured
    block freed is not reused unseen by the next: each block's growth is its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: growth is then measured over reused memory too
        pass


class PeakRSS:
    """Peak resident memory growth of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> "PeakRSS":
        _release_free_memory()
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


def compress_prefilled(engine: Engine, prefilled, ids: list[int], variant: Variant, budgets) -> dict:
    """budget -> (CompressedContext, seconds beyond the prefill, peak memory growth) for one variant;
    one scoring per distinct re-feed share (one in all for budget-free methods)."""
    check_contexts_allowed(engine.model.args)
    compressor = make_compressor(variant.method, **variant.settings)
    refeed_share = getattr(compressor, "refeed_share", lambda budget: None)  # only kv2's scores follow the budget
    scored: dict = {}  # re-feed share -> (scores, seconds, peak memory growth)
    out = {}
    for budget in budgets:
        share = refeed_share(budget)
        if share not in scored:
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                scores = run_steps(compressor.score_steps(scoring_context(engine, prefilled.seq_id, ids, budget)))
            scored[share] = (scores, time.perf_counter() - t0, mem.growth)
        scores, score_s, score_growth = scored[share]
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            keep = evict(scores, budget)
            ctx = CompressedContext.from_cache(engine.cache, prefilled.seq_id, keep, variant.method, budget)
        out[budget] = (ctx, score_s + time.perf_counter() - t0, max(score_growth, mem.growth))
    return out


def _generate_all(engine: Engine, asked: list[tuple[list[int], CompressedContext]], sampling) -> list[str]:
    """Each (prompt ids, context)'s answer under full attention over the kept tokens (what the
    compression's accuracy is), submitted together so the engine batches them."""
    texts: list[str] = []
    full = resolve(SelectionConfig(policy="full"))
    wave = engine.scheduler.cfg.max_queued_requests
    for start in range(0, len(asked), wave):
        seqs = [engine.submit(ids, sampling, full, context=ctx) for ids, ctx in asked[start : start + wave]]
        texts += [engine.run(seq).text for seq in seqs]
    return texts


def run_compression_eval(engine: Engine, cfg: CompressionEvalConfig, haystack_text: str,
                         progress: Callable[[int, int, bool], None] | None = None, log: Path | None = None,
                         resume: bool = False, on_context: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One record per (task, length, method, budget) over every question. With ``log``, each
    finished context is appended there (:class:`icekv.eval.run_log.RunLog`); ``resume`` keeps the
    contexts it already holds; ``on_context`` gets the records so far after each context run here;
    ``progress`` gets (done, total, whether the latest was kept from the log)."""
    run_log = RunLog(log, grid_of(cfg, ("tasks", "lengths", "samples")))
    finished = run_log.start(resume)
    sampler = HaystackSampler(haystack_text, engine.tokenizer)
    form = PromptFormat.from_chat_template(engine.chat_prompt) if cfg.chat_template else PromptFormat()
    contexts = cfg.contexts()
    keys = [context_key(*c) for c in contexts]
    for done, ((task, length, i), key) in enumerate(zip(contexts, keys), 1):
        resumed = key in finished
        if not resumed:
            finished[key] = _run_context(engine, cfg, sampler, form, task, length, i)
            run_log.append(finished[key])
            if on_context:
                on_context(_records(cfg, [finished[k] for k in keys if k in finished]))
        if progress:
            progress(done, len(contexts), resumed)
    return _records(cfg, [finished[k] for k in keys])


def _run_context(engine: Engine, cfg: CompressionEvalConfig, sampler: HaystackSampler, form: PromptFormat,
                 task: str, length: int, i: int) -> dict:
    """Prefill one context, compress it with every variant at every budget, ask each question of
    each compressed copy; the context's log entry."""
    seed = zlib.crc32(f"{cfg.seed}/{cfg.haystack}/reuse/{task}/{length}/{i}".encode())
    sample = make_reusable(sampler, length, seed, cfg.questions, task)
    ids = engine.tokenizer.encode(form.context(sample.context))
    t0 = time.perf_counter()
    prefilled = engine.prefill(ids)
    prefill_s = time.perf_counter() - t0
    try:
        runs = {FULL: compress_prefilled(engine, prefilled, ids, Variant(FULL, "streaming"), (1.0,))}
        for v in cfg.variants:
            runs[v.label] = compress_prefilled(engine, prefilled, ids, v, cfg.kv_budgets)
    finally:
        engine.release(prefilled)
    cells = [(label, budget, ctx, compress_s, growth) for label, by_budget in runs.items()
             for budget, (ctx, compress_s, growth) in by_budget.items()]
    asked = [(engine.tokenizer.encode(form.question(q)), ctx) for _, _, ctx, _, _ in cells for q, _ in sample.questions]
    texts = iter(_generate_all(engine, asked, SamplingConfig(max_tokens=cfg.max_tokens, stop=("\n",))))
    out = []
    for label, budget, ctx, compress_s, growth in cells:
        answers = [next(texts) for _ in sample.questions]
        out.append({"method": label, "kv_budget": budget, "answers": answers,
                    "right": [float(expected in text) for (_, expected), text in zip(sample.questions, answers)],
                    "compress_s": compress_s, "peak_memory_growth_bytes": growth,
                    "kv_bytes": ctx.kv_bytes, "full_kv_bytes": ctx.full_bytes})
    return {"context": context_key(task, length, i), "task": task, "length": length, "seed": seed,
            "context_tokens": len(ids), "expected": [a for _, a in sample.questions], "prefill_s": prefill_s,
            "cells": out}


def _records(cfg: CompressionEvalConfig, entries: list[dict]) -> list[dict]:
    """The table's rows, one per (task, length, method, budget), over the contexts of ``entries``."""
    rows: dict[tuple, list] = defaultdict(list)
    for e in entries:
        for c in e["cells"]:
            rows[(e["task"], e["length"], c["method"], c["kv_budget"])].append((e, c))
    variants = {v.label: v for v in cfg.variants} | {FULL: Variant(FULL, "streaming")}
    records = []
    for (task, length, label, budget), cells in rows.items():
        right = [s for _, c in cells for s in c["right"]]
        mean = lambda get: sum(get(e, c) for e, c in cells) / len(cells)
        low, high = wilson_interval(sum(right), len(right))
        records.append({
            "task": task, "haystack": cfg.haystack, "length": length, "method": label,
            "base_method": variants[label].method, "settings": variants[label].settings, "kv_budget": budget,
            "accuracy": sum(right) / len(right), "ci95": [low, high], "n": len(right), "contexts": len(cells),
            "prefill_s": mean(lambda e, c: e["prefill_s"]), "compress_s": mean(lambda e, c: c["compress_s"]),
            "peak_memory_growth_bytes": max(c["peak_memory_growth_bytes"] for _, c in cells),
            "kv_bytes": mean(lambda e, c: c["kv_bytes"]), "full_kv_bytes": mean(lambda e, c: c["full_kv_bytes"]),
            "chat_template": cfg.chat_template,
        })
    return records
