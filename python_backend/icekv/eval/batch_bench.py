"""Decode throughput of batched steps: B requests of one context length decoding together.

Each request's cache is the same synthesized context (:func:`synthesize`: a real prefill tiled to
the length, copied per request); the B requests decode ``steps`` tokens together through the
engine's scheduler, one engine step per token. Per (context, batch, policy): aggregate decode
tokens/s, each step's latency (median, p99) and its split (dense layers and everything else
outside attention, page selection, transfer, attention, index insertion), summed over the batch's
backends. The first step (index build, slots filled from empty) is reported on its own; it and
the next ``warmup_steps - 1`` are untimed (kernels compile at the measured shape there). Each
record goes to ``emit`` as soon as it is measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from icekv.config.request import SamplingConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.engine import Engine, Prefilled
from icekv.eval.decode_bench import synthesize
from icekv.eval.device_memory import DevicePeak
from icekv.policies import PolicyPlan

SPLIT = ("select_s", "transfer_s", "attention_s", "insert_s")


@dataclass(frozen=True)
class BatchBenchConfig:
    contexts: tuple[int, ...] = (4096, 16384)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    policies: tuple[str, ...] = ("full", "icecache")
    budget: int = 256
    steps: int = 32
    seed_tokens: int = 1024
    icecache: IceCacheConfig = IceCacheConfig()
    warmup_steps: int = 2  # untimed steps (the first included) before the timed ones
    repeats: int = 1  # timed runs per (batch, policy), interleaved; records carry the medians

    @property
    def max_tokens(self) -> int:
        """Tokens each request generates: the first from the prefill's logits, the warm-up, the timed steps."""
        return 1 + max(self.warmup_steps, 1) + self.steps


def copy_prefilled(engine: Engine, source: Prefilled) -> Prefilled:
    """A new request whose cache holds the same KV as ``source``'s."""
    req = engine.prefill(source.prompt_ids[:1])
    cache, length = engine.cache, len(source.prompt_ids)
    cache.extend(req.seq_id, length - 1)
    for layer in range(engine.model.args.num_layers):
        k, v = cache.gather(layer, source.seq_id)  # [Hkv, L, D]
        cache.write(layer, req.seq_id, 0, k.transpose(0, 1), v.transpose(0, 1))
    return Prefilled(req.seq_id, list(source.prompt_ids), source.logits, 0.0)


def time_batch(engine: Engine, reqs: list[Prefilled], plan: PolicyPlan, steps: int,
               warmup_steps: int = BatchBenchConfig.warmup_steps) -> dict:
    """Every request in ``reqs`` decodes together: a first step (index build, slots filled from
    empty) and the rest of ``warmup_steps`` untimed, then ``steps`` timed ones; the first token
    comes from the prefill's logits."""
    sampling = SamplingConfig(max_tokens=1 + max(warmup_steps, 1) + steps, ignore_eos=True)
    seqs = [engine.submit_decode(r, sampling, plan) for r in reqs]
    step_s, splits, first_s, untimed = [], [], None, 0
    with DevicePeak(engine.device) as peak:
        while not all(s.done for s in seqs):
            before = _split(seqs)
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if untimed < max(warmup_steps, 1):  # not a steady-state step
                first_s = elapsed if first_s is None else first_s
                untimed += 1
                continue
            after = _split(seqs)
            step_s.append(elapsed)
            splits.append({k: after[k] - before[k] for k in SPLIT})
    for s in seqs:
        if s.error is not None:
            raise s.error
    total = sum(step_s)
    split = {k: sum(x[k] for x in splits) / len(splits) for k in SPLIT}
    return {
        "tokens_per_s": len(reqs) * len(step_s) / total,
        "step_median_s": statistics.median(step_s),
        "step_p99_s": sorted(step_s)[min(len(step_s) - 1, round(0.99 * (len(step_s) - 1)))],
        "mean_step_s": total / len(step_s),
        "first_step_s": first_s, "warmup_steps": untimed,
        **split,
        "dense_other_s": max(total / len(step_s) - sum(split.values()), 0.0),
        "steps": len(step_s),
        "budget": seqs[0].result.budget,  # None under full attention
        "index_bytes": sum(s.result.kv.index_bytes for s in seqs),
        "resident_kv_bytes": sum(s.result.kv.resident_bytes for s in seqs),
        "device_peak_growth_bytes": peak.growth,  # measured on a GPU: slots, mirrors, activations
    }


def _split(seqs) -> dict:
    out = dict.fromkeys(SPLIT, 0.0)
    for s in seqs:
        if s.done:  # a finished request keeps its timings in its result, not its (released) backend
            timings = s.result.timings if s.result is not None else {}
        else:
            timings = s.backend.timings if s.decoder_ready else {}
        for k in SPLIT:
            out[k] += timings.get(k, 0.0)
    return out


def run_batch_bench(engine: Engine, cfg: BatchBenchConfig, seed_text: str, plans: dict[str, PolicyPlan],
                    progress: Callable[[str], None] | None = None,
                    emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Every record, each handed to ``emit`` as soon as it is measured; ``plans``: each policy's
    (:func:`icekv.eval.decode_bench.plans_for`)."""
    seed_ids = engine.tokenizer.encode(seed_text)[: cfg.seed_tokens]
    records = []
    cells = [(batch, policy) for batch in cfg.batches for policy in cfg.policies]
    for length in cfg.contexts:
        reqs = [synthesize(engine, seed_ids, length)]
        try:
            while len(reqs) < max(cfg.batches):
                reqs.append(copy_prefilled(engine, reqs[0]))
            runs = {cell: [] for cell in cells}
            for repeat in range(cfg.repeats):  # interleaved, every other pass reversed: drift falls on all alike
                for batch, policy in cells if repeat % 2 == 0 else cells[::-1]:
                    run = time_batch(engine, reqs[:batch], plans[policy], cfg.steps, cfg.warmup_steps)
                    runs[batch, policy].append(run)
                    if progress:
                        progress(f"{length} x{batch} {policy}: {run['tokens_per_s']:.1f} tokens/s, "
                                 f"step {run['step_median_s'] * 1000:.1f} ms")
            for batch, policy in cells:
                ice = policy.startswith("icecache")
                records.append({"context": length, "batch": batch, "policy": policy,
                                "search": cfg.icecache.search if ice else None,
                                "gqa_merge": cfg.icecache.gqa_merge if ice else None,
                                **median_run(runs[batch, policy])})
                if emit:
                    emit(records[-1])
        finally:
            for r in reqs:
                engine.release(r)
    return records


def median_run(runs: list[dict]) -> dict:
    """Repeated :func:`time_batch` results of one (batch, policy) -> one, with the median of every
    rate and time (``repeats``: n) and each run's rate (``tokens_per_s_runs``, in repeat order)."""
    out = dict(runs[0], repeats=len(runs), tokens_per_s_runs=[r["tokens_per_s"] for r in runs])
    for key in ("tokens_per_s", "step_median_s", "step_p99_s", "mean_step_s", "first_step_s", "dense_other_s", *SPLIT):
        out[key] = statistics.median(r[key] for r in runs)
    return out
