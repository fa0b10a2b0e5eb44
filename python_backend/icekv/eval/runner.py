"""Run RULER-style tasks across lengths, policies and budgets; one prefill per sample, shared."""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from icekv.config import IceCacheConfig, SamplingConfig, SelectionConfig
from icekv.engine import Engine
from icekv.errors import ConfigError
from icekv.eval.tasks import TASKS, HaystackSampler, PromptFormat


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation grid. ``depths`` None spreads needle depths evenly over 0..1 per sample."""

    tasks: tuple[str, ...] = ("niah_single",)
    haystack: str = "essays"
    lengths: tuple[int, ...] = (2000,)
    policies: tuple[str, ...] = ("full", "icecache")
    budgets: tuple[int, ...] = (256,)
    samples: int = 10
    seed: int = 0
    depths: tuple[float, ...] | None = None
    max_tokens: int = 12
    num_needles: int = 2  # niah_multikey: needles with distinct keys, one asked
    num_values: int = 2  # niah_multivalue: values of the one key, all asked
    probe: bool = True  # per-layer attention recall and output cosine vs full attention
    icecache: IceCacheConfig = IceCacheConfig()  # e.g. search="exhaustive"
    chat_template: bool = False  # ask each question as a user turn of the model's chat template

    def __post_init__(self) -> None:
        for t in self.tasks:
            if t not in TASKS:
                raise ConfigError(f"--task: unknown task {t!r}; choose from {', '.join(TASKS)}")
        if self.samples < 1:
            raise ConfigError(f"--samples must be >= 1, got {self.samples}")
        for pol in self.policies:  # validates policy names and budgets early, with their messages
            for b in self.budgets:
                SelectionConfig(policy=pol, budget=b)

    def selections(self) -> list[SelectionConfig]:
        out = [SelectionConfig(policy="full")] if "full" in self.policies else []
        return out + [SelectionConfig(policy=p, budget=b, icecache=self.icecache)
                      for p in self.policies if p != "full" for b in self.budgets]


def _sample_seed(cfg: EvalConfig, task: str, length: int, i: int) -> int:
    return zlib.crc32(f"{cfg.seed}/{cfg.haystack}/{task}/{length}/{i}".encode())


def run_eval(engine: Engine, cfg: EvalConfig, haystack_text: str,
             progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Returns one record per (task, length, policy, budget) with accuracy over ``samples``."""
    sampler = HaystackSampler(haystack_text, engine.tokenizer)
    form = PromptFormat.from_chat_template(engine.chat_prompt) if cfg.chat_template else PromptFormat()
    selections = cfg.selections()
    sampling = SamplingConfig(max_tokens=cfg.max_tokens, stop=("\n",))
    acc: dict[tuple, list] = defaultdict(list)
    total, done = len(cfg.tasks) * len(cfg.lengths) * cfg.samples * len(selections), 0
    for task in cfg.tasks:
        for length in cfg.lengths:
            for i in range(cfg.samples):
                depth = cfg.depths[i % len(cfg.depths)] if cfg.depths else (i + 0.5) / cfg.samples
                sample = sampler.make(task, length, _sample_seed(cfg, task, length, i), depth=depth,
                                      num_needles=cfg.num_needles, num_values=cfg.num_values)
                req = engine.prefill(engine.tokenizer.encode(form.prompt(sample.prompt)))
                try:
                    for sel in selections:
                        gen = engine.decode(req, sampling, sel, probe=cfg.probe and sel.policy != "full")
                        key = (task, length, sel.policy, sel.attended_budget)
                        acc[key].append((sample.score(gen.text), gen))
                        done += 1
                        if progress:
                            progress(done, total)
                finally:
                    engine.release(req)
    return _records(cfg, acc)


def _records(cfg: EvalConfig, acc: dict) -> list[dict]:
    full = {(t, n): sum(s for s, _ in v) / len(v) for (t, n, p, _), v in acc.items() if p == "full"}
    records = []
    for (task, length, policy, budget), runs in acc.items():
        scores = [s for s, _ in runs]
        accuracy = sum(scores) / len(scores)
        layers: dict[int, list] = defaultdict(list)
        for _, gen in runs:
            for layer, st in gen.layer_stats.items():
                layers[layer].append(st)
        per_layer = {
            layer: {k: sum(s[k] for s in v) / len(v) for k in ("recall", "cosine")} for layer, v in sorted(layers.items())
        }
        base = full.get((task, length))
        records.append({
            "task": task, "haystack": cfg.haystack, "length": length, "policy": policy, "budget": budget,
            "chat_template": cfg.chat_template,
            "accuracy": accuracy, "n": len(scores),
            "ratio_to_full": accuracy / base if base else None,
            "recall": sum(v["recall"] for v in per_layer.values()) / len(per_layer) if per_layer else None,
            "cosine": sum(v["cosine"] for v in per_layer.values()) / len(per_layer) if per_layer else None,
            "tpot_s": sum(g.tpot_s for _, g in runs) / len(runs),
            "resident_bytes": max(g.kv.resident_bytes for _, g in runs),
            "total_bytes": max(g.kv.total_bytes for _, g in runs),
            "layers": per_layer,
        })
    return records
