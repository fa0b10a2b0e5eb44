"""A replica's load under vLLM's metric names, for the routers and endpoint pickers that read them.

The Gateway API Inference Extension's endpoint picker scrapes each pod's serving port at
``/metrics`` and reads vLLM's names by default (queue depth, running requests, KV-cache usage);
llm-d's schedulers also read vLLM's prefix-cache counters. icekv's own metrics are the Triton
model's, on Triton's metrics port: the frontend's ``/metrics`` serves all of them, followed by the
vLLM-named series derived from them. Each derived value has one source, an ``icekv_*`` series.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class DerivedMetric:
    """One vLLM-named series, computed from the ``icekv_*`` values it names."""

    name: str
    kind: str  # gauge | counter
    help: str
    sources: tuple[str, ...]
    value: Callable[..., float]  # of the sources' values, in order


def _used_fraction(in_use: float, pages: float) -> float:
    return in_use / pages if pages else 0.0


VLLM_METRICS = (
    DerivedMetric("vllm:num_requests_running", "gauge", "requests being prefilled or decoded",
                  ("icekv_active_requests",), float),
    DerivedMetric("vllm:num_requests_waiting", "gauge", "requests waiting for memory or a turn",
                  ("icekv_queued_requests",), float),
    DerivedMetric("vllm:kv_cache_usage_perc", "gauge", "fraction of the KV page pool live requests hold (0 to 1; "
                  "idle prefix-cache pages count as free)", ("icekv_kv_pool_pages_in_use", "icekv_kv_pool_pages"),
                  _used_fraction),
    DerivedMetric("vllm:prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache",
                  ("icekv_prefix_cache_hit_tokens_total", "icekv_prefix_cache_miss_tokens_total"),
                  lambda hits, misses: hits + misses),
    DerivedMetric("vllm:prefix_cache_hits_total", "counter", "prompt tokens the prefix cache held",
                  ("icekv_prefix_cache_hit_tokens_total",), float),
)


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")  # name, labels, value (then a time)


def sample_values(text: str) -> dict[str, float]:
    """Each metric's value in a Prometheus text exposition, summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line.strip())
        if sample is None:  # a comment, a blank line
            continue
        try:
            value = float(sample[2])
        except ValueError:
            continue
        if math.isfinite(value):
            values[sample[1]] = values.get(sample[1], 0.0) + value
    return values


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def vllm_exposition(icekv_text: str, model_name: str) -> str:
    """The vLLM-named series derived from ``icekv_text`` (Triton's metrics), labelled with the
    served model's name; a series whose sources are absent (the model not loaded yet) is left out."""
    values = sample_values(icekv_text)
    lines = []
    for metric in VLLM_METRICS:
        if any(source not in values for source in metric.sources):
            continue
        value = metric.value(*(values[source] for source in metric.sources))
        lines += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}",
                  f'{metric.name}{{model_name="{_label(model_name)}"}} {value!r}']
    return "\n".join(lines) + "\n" if lines else ""
