"""Accuracy over an evaluation's runs: per (task, length, policy, budget), with 95% intervals."""

from __future__ import annotations

import math
from collections import defaultdict


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound at 0% and 100%, unlike p +- 1.96 se)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def aggregate(runs: list[dict], haystack: str, chat_template: bool) -> list[dict]:
    """One record per (task, length, policy, budget) from the runs (one per question and selection):
    accuracy and its interval, the ratio to the full cache's accuracy on the same questions, mean
    attention recall and output cosine (per layer and overall), time per token and its split."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], r["length"], r["policy"], r["budget"])].append(r)
    full = {(t, n): _mean([r["score"] for r in rs]) for (t, n, p, _), rs in groups.items() if p == "full"}
    records = []
    for (task, length, policy, budget), rs in groups.items():
        scores = [r["score"] for r in rs]
        accuracy = sum(scores) / len(scores)
        low, high = wilson_interval(sum(scores), len(scores))
        layers: dict[str, list] = defaultdict(list)
        for r in rs:
            for layer, st in r["layers"].items():
                layers[str(layer)].append(st)
        per_layer = {layer: {k: _mean([s[k] for s in v]) for k in ("recall", "cosine")}
                     for layer, v in sorted(layers.items(), key=lambda x: int(x[0]))}
        base = full.get((task, length))
        stages = sorted({k for r in rs for k in r["timings"]})
        records.append({
            "task": task, "haystack": haystack, "length": length, "policy": policy, "budget": budget,
            "chat_template": chat_template, "accuracy": accuracy, "n": len(scores), "ci95": [low, high],
            "ratio_to_full": accuracy / base if base else None,
            "recall": _mean([v["recall"] for v in per_layer.values()]),
            "cosine": _mean([v["cosine"] for v in per_layer.values()]),
            "tpot_s": _mean([r["tpot_s"] for r in rs]),
            "timings": {k: _mean([r["timings"].get(k, 0.0) for r in rs]) for k in stages},
            "resident_bytes": max(r["resident_bytes"] for r in rs),
            "total_bytes": max(r["total_bytes"] for r in rs),
            "layers": per_layer,
        })
    return records
