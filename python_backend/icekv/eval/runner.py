"""Run RULER-style tasks across lengths, policies and budgets: each context is prefilled once, and
every question asked of it is decoded from that one prefill under every (policy, budget).

At length the prefill is the cost (minutes per 16k-token context on a CPU), so a context carries
several questions (one per needle, or per key, or per variable chain) and a run logs each answered
question, then each finished context, to ``runs.jsonl``: a run of hours can be read while it runs,
and resumed after an interruption (``resume``) without redoing a finished context, nor a question
of an unfinished one (its context is prefilled again).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from icekv.config.request import PromptCaching, SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine
from icekv.errors import ConfigError
from icekv.eval.needles import check_distinct_key_words, longest_answer_room
from icekv.eval.run_log import ContextGrid, RunLog, context_key, grid_of
from icekv.eval.stats import aggregate
from icekv.eval.tasks import TASKS, ContextSample, HaystackSampler, PromptFormat
from icekv.policies import PolicyPlan, resolve

@dataclass(frozen=True)
class EvalConfig(ContextGrid):
    """One evaluation grid. ``depths`` None spreads a lone needle's depth evenly over 0..1 per
    sample; ``questions`` are asked of each context (each its own needle, key or chain)."""

    tasks: tuple[str, ...] = ("niah_single",)
    haystack: str = "essays"
    lengths: tuple[int, ...] = (2000,)
    policies: tuple[str, ...] = ("full", "icecache")
    budgets: tuple[int, ...] = (256,)
    samples: int = 10  # contexts per task and length
    questions: int = 1  # per context
    seed: int = 0
    depths: tuple[float, ...] | None = None
    max_tokens: int = 12  # least room for an answer; a longer answer gets its Question.answer_room
    num_needles: int = 2  # niah_multikey: needles with distinct keys in all (the asked ones, then distractors);
    # recall_all: the needles, every one asked
    num_values: int = 2  # niah_multivalue: values of each asked key, all expected
    num_hops: int = 4  # variable_tracking: assignments after the first in each chain; cot_arith: changes after the start
    distinct_key_words: bool = False  # niah tasks: no word shared by two keys of a context
    probe: bool = True  # per-layer attention recall and output cosine vs full attention
    icecache: IceCacheConfig = IceCacheConfig()  # e.g. search="exhaustive"
    chat_template: bool = False  # ask each question as a user turn of the model's chat template

    def __post_init__(self) -> None:
        for t in self.tasks:
            if t not in TASKS:
                raise ConfigError(f"--task: unknown task {t!r}; choose from {', '.join(TASKS)}")
        if self.samples < 1 or self.questions < 1:
            raise ConfigError(f"--samples and --questions must be >= 1, got {self.samples} and {self.questions}")
        for one in ("passkey", "recall_all", "cot_arith"):
            if one in self.tasks and self.questions > 1:
                raise ConfigError(f"--task {one} asks one question of a context: it takes --questions 1")
        if "niah_multikey" in self.tasks and self.num_needles <= self.questions:
            raise ConfigError(f"niah_multikey needs distractors: --num-needles ({self.num_needles}) must exceed "
                              f"--questions ({self.questions})")
        if self.distinct_key_words:
            for t in self.tasks:
                if t.startswith("niah_") or t == "recall_all":
                    check_distinct_key_words(t, self.questions, self.num_needles)

    @property
    def answer_tokens(self) -> int:
        """``max_tokens``, or the longest :attr:`Question.answer_room` a task here may need, whichever
        is more."""
        return max([self.max_tokens] + [longest_answer_room(t, self.num_values, self.num_hops, self.num_needles)
                                   for t in self.tasks])

    def plans(self) -> list[PolicyPlan]:
        """Every (policy, budget) of the grid resolved, full attention once (ConfigError for a
        policy unknown or a budget it cannot use): what a front end resolves before loading."""
        out = [resolve(SelectionConfig(policy="full"))] if "full" in self.policies else []
        return out + [resolve(SelectionConfig(policy=p, budget=b, icecache=self.icecache))
                      for p in self.policies if p != "full" for b in self.budgets]


@dataclass(frozen=True)
class ContextPrompts:
    """One context of a grid, as token ids: the context, and after it each question's suffix and the
    tokens its answer is decoded under. Every engine evaluated on the grid gets these ids."""

    seed: int
    sample: ContextSample
    context_ids: list[int]
    suffixes: list[list[int]]
    max_tokens: list[int]


def context_prompts(cfg: EvalConfig, sampler: HaystackSampler, form: PromptFormat, encode: Callable[[str], list[int]],
                    task: str, length: int, i: int) -> ContextPrompts:
    """The ``i``-th context of ``task`` at ``length``: its seed and needle depth follow from the grid."""
    depth = cfg.depths[i % len(cfg.depths)] if cfg.depths else (i + 0.5) / cfg.samples
    seed = zlib.crc32(f"{cfg.seed}/{cfg.haystack}/{task}/{length}/{i}".encode())
    sample = sampler.make_context(task, length, seed, cfg.questions, depth if cfg.questions == 1 else None,
                                  cfg.num_needles, cfg.num_values, cfg.num_hops, cfg.distinct_key_words)
    return ContextPrompts(seed, sample, encode(form.context(sample.context)),
                          [encode(form.question(q.text)) for q in sample.questions],
                          [q.tokens_to_decode(cfg.max_tokens) for q in sample.questions])


def run_eval(engine: Engine, cfg: EvalConfig, haystack_text: str,
             progress: Callable[[int, int, bool], None] | None = None, log: Path | None = None,
             resume: bool = False, on_context: Callable[[list[dict]], None] | None = None,
             plans: list[PolicyPlan] | None = None) -> list[dict]:
    """Returns one record per (task, length, policy, budget) with accuracy over every question,
    under ``plans`` (None: ``cfg.plans()``).
    With ``log``, each finished context's runs are appended there as one JSON line (flushed);
    ``resume`` keeps the contexts the log already holds (it must come from the same grid);
    ``on_context`` gets the records so far after each context run here; ``progress`` gets (done,
    total, whether the latest were kept from the log)."""
    growable = _growable(cfg)
    run_log = RunLog(log, grid_of(cfg, growable), defaults=grid_of(EvalConfig(), growable))
    finished = run_log.start(resume)
    sampler = HaystackSampler(haystack_text, engine.tokenizer)
    form = PromptFormat.from_chat_template(engine.chat_prompt) if cfg.chat_template else PromptFormat()
    plans = plans or cfg.plans()
    total = len(cfg.contexts()) * cfg.questions * len(plans)
    count = {"done": 0}

    def on_run(n: int = 1, resumed: bool = False) -> None:
        count["done"] += n
        if progress:
            progress(count["done"], total, resumed)

    runs = []
    for task, length, i in cfg.contexts():
        key = context_key(task, length, i)
        if key in finished:
            on_run(len(finished[key]["runs"]), resumed=True)
        else:
            finished[key] = _run_context(engine, cfg, sampler, form, plans, task, length, i, on_run, run_log)
            run_log.append(finished[key])
            if on_context:
                on_context(aggregate(runs + finished[key]["runs"], cfg.haystack, cfg.chat_template))
        runs += finished[key]["runs"]
    return aggregate(runs, cfg.haystack, cfg.chat_template)


def _run_context(engine: Engine, cfg: EvalConfig, sampler: HaystackSampler, form: PromptFormat,
                 plans: list[PolicyPlan], task: str, length: int, i: int,
                 on_run: Callable[..., None], run_log: RunLog) -> dict:
    """Prefill one context, ask each of its questions under every plan (each question's runs
    logged as it is answered; those an interrupted run logged are kept); the context's log entry."""
    key = context_key(task, length, i)
    prompts = context_prompts(cfg, sampler, form, engine.tokenizer.encode, task, length, i)
    sample, context_ids, suffixes = prompts.sample, prompts.context_ids, prompts.suffixes
    max_tokens = prompts.max_tokens
    answered = dict(run_log.asked(key))  # question -> its runs
    for runs in answered.values():
        on_run(len(runs), resumed=True)
    todo = [q for q in range(len(sample.questions)) if q not in answered]
    if todo:
        engine.check_fits(len(context_ids) + max(map(len, suffixes)), max(max_tokens))  # before a long prefill
    # through the prefix cache: a context a lower tier (--prefix-store) holds is read back, not prefilled
    req = engine.prefill(context_ids, caching=PromptCaching()) if todo else None
    try:
        for q in todo:
            question, suffix, limit = sample.questions[q], suffixes[q], max_tokens[q]
            sampling = SamplingConfig(max_tokens=limit, stop=question.stop)
            answered[q] = []
            for plan in plans:
                gen = engine.decode(req, sampling, plan, probe=cfg.probe and plan.sparse, suffix=suffix)
                answered[q].append({"task": task, "length": length, "sample": i, "question": q,
                                    "policy": plan.name, "budget": gen.budget,
                                    "score": question.score(gen.text), "output": gen.text, "max_tokens": limit,
                                    "expected": list(question.answers), "prompt_tokens": gen.prompt_tokens,
                                    "tpot_s": gen.tpot_s, "timings": gen.timings, "layers": gen.layer_stats,
                                    "resident_bytes": gen.kv.resident_bytes, "total_bytes": gen.kv.total_bytes})
                on_run()
            run_log.append_question(key, q, answered[q])
    finally:
        if req is not None:
            engine.release(req)
    return {"context": key, "seed": prompts.seed, "context_tokens": len(context_ids), "depths": list(sample.depths),
            "prefill_s": req.prefill_s if req is not None else None,  # a read where the prefix store held it
            "prefill_cached_tokens": req.cached_tokens if req is not None else None,
            "runs": [r for q in sorted(answered) for r in answered[q]]}


def _growable(cfg: EvalConfig) -> tuple[str, ...]:
    """The fields a log's contexts do not depend on: a resumed run may grow the tasks, lengths and
    samples (samples: unless they spread a lone needle's depth)."""
    return ("tasks", "lengths") + (("samples",) if cfg.questions > 1 or cfg.depths else ())
