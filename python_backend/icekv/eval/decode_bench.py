"""Decode latency per output token across context lengths and policies, split by stage.

Contexts are *synthesized* unless listed in ``ttft_contexts``: the KV of a real prefill of essay
text is tiled until the cache has the asked length (latency does not depend on the text; the
keys keep realistic norms and structure). Listed contexts are really prefilled (the essay tokens
tiled), which times the first token: ``ttft_s`` = prefill + index build. Where the engine has
index threads, that prefill builds the first sparse policy's index layer by layer as it goes (as
serving does), so that policy's first decode waits only for what is left of the build
(``index_prebuilt``); the other policies build theirs after prefill. The same cache serves every
policy and, with ``peer_hf``, Hugging Face transformers' own full-cache decoding on the same model.

Each timed decode starts with ``warmup_steps`` untimed steps at the measured shape (the same
request, context and policy: kernels compile and caches fill there, not in the timed steps);
``tpot_s`` is the mean of the timed steps, ``tpot_median_s`` their median (the steady state) and
the stage split covers the timed steps only: page search, transfer, attention, insertion, the
linear layers (``weights_s``, on a CPU: :mod:`icekv.eval.linear_clock`) and the rest (norms, rotary,
sampling, Python). With ``window``, a record also splits its timed steps into windows of that
many (a long output: the index grows as the output does), each with its step times, its stage
split and how the request's KV and index bytes grew per token. Each record goes to ``emit`` as
soon as it is measured.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from icekv.engine.sequence import Sequence

import torch

from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.methods.icecache import IceCacheConfig
from icekv.devices import synchronize
from icekv.errors import ConfigError
from icekv.engine import Engine, Prefilled
from icekv.eval.device_memory import DevicePeak
from icekv.eval.hf_peer import hf_model
from icekv.eval.linear_clock import LinearClock
from icekv.policies import PolicyPlan, resolve


@dataclass(frozen=True)
class DecodeBenchConfig:
    contexts: tuple[int, ...] = (4096, 8192, 16384, 32768)
    policies: tuple[str, ...] = ("full", "icecache", "icecache_r")
    budget: int = 256
    steps: int = 16
    seed_tokens: int = 1024  # real prefill that is tiled into the synthesized cache
    peer_hf: bool = False
    ttft_contexts: tuple[int, ...] = ()  # contexts really prefilled (slow), to time the first token
    icecache: IceCacheConfig = IceCacheConfig()  # e.g. search="exhaustive"
    unlimited_layers: int = SelectionConfig.n_unlimited_layers  # first layers kept whole
    repeats: int = 1  # timed decodes per policy, interleaved; records carry the medians
    warmup_steps: int = 2  # untimed decode steps before the timed ones, at the measured shape
    window: int | None = None  # timed steps per window of a long output's report (None: no windows)

    def __post_init__(self) -> None:
        if self.window is not None and (self.window < 1 or self.warmup_steps < 1 or self.repeats > 1):
            raise ConfigError("a window is >= 1 step, follows at least one warm-up step (the decode's first step "
                              "builds its index) and reports one run (no repeats)")

    @property
    def max_tokens(self) -> int:
        """Tokens each decode generates: the first comes from the prefill's logits, then the
        warm-up steps, then the timed ones."""
        return 1 + self.warmup_steps + self.steps


def synthesize(engine: Engine, seed_ids: list[int], length: int) -> Prefilled:
    """A request whose cache holds ``length`` tokens: a real prefill of ``seed_ids``, tiled."""
    seed = engine.prefill(seed_ids)
    n = len(seed_ids)
    req = engine.prefill(seed_ids[:1])  # allocate a fresh sequence
    cache = engine.cache
    start = cache.extend(req.seq_id, length - 1)
    for layer in range(engine.model.args.num_layers):
        k, v = cache.gather(layer, seed.seq_id)  # [Hkv, n, D]
        for pos in range(start, length, n):
            m = min(n, length - pos)
            cache.write(layer, req.seq_id, pos, k[:, :m].transpose(0, 1), v[:, :m].transpose(0, 1))
    engine.release(seed)
    return Prefilled(req.seq_id, [seed_ids[0]] * length, seed.logits, 0.0)


def hf_decode(engine: Engine, req: Prefilled, steps: int) -> tuple[float, list[int]]:
    """Transformers' own model + DynamicCache greedy-decoding over a copy of the request's KV: its
    seconds per token over ``steps`` timed steps (after one untimed), and the tokens it generated
    (the first from the prefill's logits, as icekv's)."""
    from transformers import DynamicCache

    model, device = hf_model(engine), engine.device
    cache = DynamicCache()
    for layer in range(engine.model.args.num_layers):
        k, v = engine.cache.gather(layer, req.seq_id)  # [Hkv, L, D]
        cache.update(k[None].to(device, copy=True), v[None].to(device, copy=True), layer)
    length = len(req.prompt_ids)
    tokens = [int(req.logits.argmax())]

    def step(i: int) -> None:
        token = torch.tensor([[tokens[-1]]], device=device)
        out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[length + i]], device=device))
        tokens.append(int(out.logits[0, -1].argmax()))

    with torch.no_grad():
        step(0)  # warm-up
        synchronize(device)
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            step(i)
        synchronize(device)
    return (time.perf_counter() - t0) / steps, tokens


def run_decode_bench(engine: Engine, cfg: DecodeBenchConfig, seed_text: str, plans: dict[str, PolicyPlan],
                     progress: Callable[[str], None] | None = None,
                     emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Every record, each handed to ``emit`` as soon as it is measured; ``plans``: each policy's
    (:func:`plans_for`)."""
    emit = emit or (lambda record: None)
    seed_ids = engine.tokenizer.encode(seed_text)[: cfg.seed_tokens]
    records = []
    for length in cfg.contexts:
        if length in cfg.ttft_contexts:  # the seed text tiled to ``length``, through the model
            sparse = [p for p in cfg.policies if p != "full"]
            req = engine.prefill((seed_ids * -(-length // len(seed_ids)))[:length],
                                 selection=plans[sparse[0]] if sparse else None)
            prefill_s = req.prefill_s
        else:
            req, prefill_s = synthesize(engine, seed_ids, length), None
        try:
            runs = {policy: [] for policy in cfg.policies}
            for _ in range(cfg.repeats):  # interleaved: a drifting machine slows every policy alike
                for policy in cfg.policies:
                    runs[policy].append(time_policy(engine, req, cfg, plans[policy], prefill_s))
                    if progress:
                        progress(f"{length} {policy}: {runs[policy][-1]['tpot_s'] * 1000:.1f} ms/token")
            for policy in cfg.policies:
                records.append(median_record(runs[policy]))
                emit(records[-1])
            if cfg.peer_hf:
                tpot, _ = hf_decode(engine, req, cfg.steps)
                records.append({"context": length, "policy": "hf_transformers", "budget": None, "tpot_s": tpot,
                                "steps": cfg.steps})
                emit(records[-1])
                if progress:
                    progress(f"{length} hf_transformers: {tpot * 1000:.1f} ms/token")
        finally:
            engine.release(req)
    return records


def plans_for(cfg) -> dict[str, PolicyPlan]:
    """Each policy of a bench's ``cfg`` resolved at its budget and IceCache settings (and its
    unlimited layers where it sets them); ConfigError for one it cannot run."""
    unlimited = getattr(cfg, "unlimited_layers", SelectionConfig.n_unlimited_layers)
    return {policy: resolve(SelectionConfig(policy=policy, budget=cfg.budget, icecache=cfg.icecache,
                                            n_unlimited_layers=unlimited)) for policy in cfg.policies}


def time_policy(engine: Engine, req: Prefilled, cfg: DecodeBenchConfig, plan: PolicyPlan,
                prefill_s: float | None) -> dict:
    """One decode under ``plan`` from the request's cache, ``cfg.warmup_steps`` untimed steps
    then ``cfg.steps`` timed ones: a record."""
    sampling = SamplingConfig(max_tokens=cfg.max_tokens, ignore_eos=True)
    policy = plan.name
    prebuilt = req.prebuilt_index(plan) is not None  # this decode takes prefill's index
    with DevicePeak(engine.device) as peak:
        seq = engine.submit_decode(req, sampling, plan)
        warm = step_until(engine, seq, cfg.warmup_steps)  # stage times after the warm-up
        with LinearClock(engine.model) as linears:
            marks = [_mark(seq, 0), *_window_marks(engine, seq, cfg.warmup_steps, cfg.window)] if cfg.window else []
            gen = engine.run(seq)
    timed = seq.step_s[cfg.warmup_steps:] or seq.step_s[-1:]  # each timed step's wall time
    steps = len(timed)
    split = stage_split(warm, gen.timings, steps)
    if engine.device.type == "cpu":  # on a GPU the layers' calls return before their kernels end
        split["weights_s"] = linears.seconds / steps
    tpot = sum(timed) / steps
    ice = policy.startswith("icecache")
    index_build_s = gen.timings.get("index_build_s", 0.0)
    return {
        "context": len(req.prompt_ids), "policy": policy, "budget": gen.budget,
        "search": cfg.icecache.search if ice else None,
        "rerank": cfg.icecache.rerank if ice and cfg.icecache.search == "centroids" else None,
        "min_candidates": cfg.icecache.min_candidates if ice and cfg.icecache.search == "centroids" else None,
        "score_dtype": cfg.icecache.page_keys(engine.cache.dtype) if ice else None,
        "centroid_scoring": cfg.icecache.centroid_scoring if ice else None,
        "rescoring": cfg.icecache.rescoring if ice else None,
        "gqa_merge": cfg.icecache.gqa_merge if ice else None,
        "tpot_s": tpot, "tpot_median_s": statistics.median(timed), "step_max_s": max(timed),
        "first_step_s": gen.first_step_s, "warmup_steps": len(seq.step_s) - steps, "weights_s": None, **split,
        "other_s": max(tpot - sum(split.values()), 0.0),
        "index_build_s": index_build_s,
        "index_prebuilt": prebuilt,
        # the index is built before the second token; counted in TTFT to be conservative
        "prefill_s": prefill_s,
        "ttft_s": None if prefill_s is None else prefill_s + index_build_s,
        "resident_kv_bytes": gen.kv.resident_bytes, "total_kv_bytes": gen.kv.total_bytes,
        "device_peak_growth_bytes": peak.growth,  # measured on a GPU: slots, mirrors, activations
        "index_bytes": gen.kv.index_bytes,
        # host -> device over the decode (the first step fills empty slots): KV pages, index copies
        "kv_bytes_moved": gen.kv.bytes_moved, "index_bytes_moved": gen.kv.index_bytes_moved,
        "steps": steps,
        "windows": _windows(seq.step_s[cfg.warmup_steps:], [*marks, (steps, gen.timings, gen.kv)]) if marks else None,
    }


def _mark(seq: Sequence, timed: int) -> tuple[int, dict, object]:
    """(timed steps done, the decode's stage times so far, its KV stats now)."""
    return timed, dict(seq.backend.timings), seq.backend.kv_stats()


def _window_marks(engine: Engine, seq: Sequence, warmup: int, window: int) -> list[tuple[int, dict, object]]:
    """Step ``seq`` until it is done, marking every ``window`` timed steps (but the last)."""
    marks = []
    while not seq.done:
        engine.step()
        timed = len(seq.step_s) - warmup
        if not seq.done and timed and timed % window == 0:
            marks.append(_mark(seq, timed))
    return marks


def _windows(step_s: list[float], marks: list[tuple[int, dict, object]]) -> list[dict]:
    """Per window between consecutive marks: its steps' times, stage split per step, and the KV
    and index bytes it added per step (the request's own pages, all layers; the index's host memory)."""
    out = []
    for (start, before, kv0), (end, after, kv1) in zip(marks, marks[1:]):
        times, n = step_s[start:end], end - start
        out.append({"start": start, "steps": n, "tpot_s": sum(times) / n, "tpot_median_s": statistics.median(times),
                    "step_max_s": max(times), **stage_split(before, after, n),
                    "kv_bytes_per_token": (kv1.total_bytes - kv0.total_bytes) / n,
                    "index_bytes_per_token": (kv1.index_bytes - kv0.index_bytes) / n, "index_bytes": kv1.index_bytes})
    return out


def stage_split(before: dict, after: dict, steps: int) -> dict:
    """Seconds per step of each stage of :data:`SPLIT` between two reads of a decode's stage times."""
    return {k: (after.get(k, 0.0) - before.get(k, 0.0)) / steps for k in SPLIT}


def step_until(engine: Engine, seq: Sequence, steps: int) -> dict:
    """Step the engine until ``seq`` has decoded ``steps`` steps (or is done); its stage times then."""
    while not seq.done and len(seq.step_s) < steps:
        engine.step()
    return dict(seq.backend.timings) if not seq.done and seq.decoder_ready else {}


SPLIT = ("select_s", "transfer_s", "attention_s", "insert_s")
FIRST_TOKEN = ("index_build_s", "ttft_s")
TIMES = ("tpot_s", "tpot_median_s", "step_max_s", "first_step_s", "select_s", "transfer_s", "attention_s", "insert_s",
         "weights_s", "other_s", "index_build_s", "ttft_s")


def median_record(runs: list[dict]) -> dict:
    """Repeated records of one policy -> one record with the median of every time (``repeats``: n).

    When the first decode took the index prefill built, its index build and time to first token
    are kept as they are: that is the first token a user waits for; later decodes rebuild."""
    out = dict(runs[0], repeats=len(runs))
    for key in TIMES:
        if runs[0][key] is not None and not (key in FIRST_TOKEN and runs[0].get("index_prebuilt")):
            out[key] = statistics.median(r[key] for r in runs)
    return out
