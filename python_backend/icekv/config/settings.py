"""Every server setting, declared once: its name, type, choices, meaning and where it applies.

A setting is a Triton model parameter (config.pbtxt, ``name``), an ``icekv serve`` / ``icekv demo``
flag (the name with dashes, unless ``flag`` says otherwise) and, where ``configmap``, a key of
deploy/base/configmap.yaml (``ICEKV_<NAME>``). Its default is the one of the config field it sets
(:class:`icekv.config.serving.ServingConfig`, whose engine's defaults are the library's). The CLI's flags, the
parsing of config.pbtxt, the generated model repository and the README's configuration table all
come from :data:`SETTINGS`; a test checks the ConfigMap and the README against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from icekv.config.engine import DTYPES, KV_POOLS, WEIGHT_FORMATS
from icekv.config.paging import KV_DTYPES
from icekv.config.paths import build_config, field_value
from icekv.config.serving import TOOL_FORMATS, ServingConfig
from icekv.errors import ConfigError
from icekv.methods.icecache import CENTROID_SCORING, GQA_MERGES, RESCORING, SCORE_DTYPES, SEARCHES


@dataclass(frozen=True)
class Setting:
    name: str  # the Triton parameter; ``--name-with-dashes`` the flag
    fields: tuple[str, ...]  # the ServingConfig fields it sets (dotted paths)
    meaning: str  # the flag's help and the README's description
    kind: Callable = int  # int | float | str | bool
    choices: tuple[str, ...] = ()
    least: float | None = 1  # the smallest number it takes (None: no bound); ints and floats only
    configmap: bool = False  # a key of the Kubernetes ConfigMap, passed to ``icekv serve`` as its flag
    flag: str | None = None  # the flag, where it is not the name with dashes
    default_doc: str | None = None  # the default in words, where its value alone does not say it

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's attribute on argparse's namespace."""
        return self.cli_flag.removeprefix("--").replace("-", "_")

    @property
    def configmap_key(self) -> str | None:
        return f"ICEKV_{self.name.upper()}" if self.configmap else None

    def default(self):
        return field_value(ServingConfig(), self.fields[0])

    def parse(self, text: str):
        """The value of ``text``; ConfigError naming the parameter when it is not one."""
        if self.kind is bool:
            if text.strip().lower() in ("true", "on", "1"):
                return True
            if text.strip().lower() in ("false", "off", "0"):
                return False
            raise ConfigError(f"{self.name} must be true or false, got {text!r}")
        if self.kind is str:
            if self.choices and text not in self.choices:
                raise ConfigError(f"{self.name} must be one of {', '.join(self.choices)}, got {text!r}")
            return text
        try:
            value = self.kind(text)
        except ValueError:
            what = "an integer" if self.kind is int else "a number"
            raise ConfigError(f"{self.name} must be {what}, got {text!r}") from None
        if self.least is not None and value < self.least:
            raise ConfigError(f"{self.name} must be >= {self.least}, got {text}")
        return value


def _policy_names() -> tuple[str, ...]:
    from icekv.policies import policy_names  # the registry (it imports torch): only when the names are asked for

    return policy_names()


SETTINGS = (
    Setting("model_dir", ("engine.model_dir",), "model: a known model name (`icekv fetch --list`; fetched on first "
            "use), a folder in Hugging Face layout, or a GGUF file (converted once into the cache)", str,
            configmap=True, flag="--model",
            default_doc="`smollm2-135m` (SmolLM2-135M-Instruct in `$ICEKV_CACHE`)"),
    Setting("device", ("engine.device",), "compute device: `auto` (a GPU when there is one), `cpu`, `cuda`, "
            "`cuda:N`", str, configmap=True, default_doc="`auto` (`cuda` in the GPU overlay)"),
    Setting("kv_pool", ("engine.kv_pool",), "KV page pool: `host` (pinned for a GPU), `device`, `auto` (host under "
            "a sparse policy)", str, KV_POOLS),
    Setting("policy", ("engine.selection.policy",), "page selection policy (the baselines: docs/baselines.md)", str,
            configmap=True),
    Setting("budget", ("engine.selection.budget",), "tokens attended per layer per KV head", configmap=True),
    Setting("unlimited_layers", ("engine.selection.n_unlimited_layers",), "first layers that keep their whole "
            "cache under a sparse policy (0: every layer under the budget); with sliding-window layers, the first "
            "global ones", least=0),
    Setting("search", ("engine.selection.icecache.search",), "icecache page search: the DCI tree walk (the "
            "paper's), every page scored exactly, or pages ranked by centroid with the best rescored exactly", str,
            SEARCHES, configmap=True),
    Setting("rerank", ("engine.selection.icecache.rerank",), "`centroids`: pages rescored exactly per query head, "
            "as a multiple of the pages selected (with a floor for small budgets)"),
    Setting("min_candidates", ("engine.selection.icecache.min_candidates",), "`centroids`: the floor under `rerank`: "
            "at least this many pages rescored exactly per query head"),
    Setting("score_dtype", ("engine.selection.icecache.score_dtype",), "index page-key dtype: `auto` (the KV's "
            "width: bf16 under a bf16 or fp16 cache, fp32 under fp32), or bfloat16 (half fp32's memory), int8 with a "
            "scale per key (about a quarter)", str, SCORE_DTYPES, configmap=True),
    Setting("centroid_scoring", ("engine.selection.icecache.centroid_scoring",), "where `centroids` ranks pages by "
            "centroid: `device` (a copy of the centroids there), `host` (device memory flat in the context), `auto` "
            "(device on a GPU)", str, CENTROID_SCORING),
    Setting("rescoring", ("engine.selection.icecache.rescoring",), "where `centroids` rescores its candidates: "
            "`host` (from the index), `device` (a cache of recent candidates' keys there, refilled with the pages it "
            "lacks; ranks there too)", str, RESCORING),
    Setting("gqa_merge", ("engine.selection.icecache.gqa_merge",), "how the query heads of a KV head share its "
            "pages: interleaved by rank, a rank's heads in head order (the authors') or best score first (the few "
            "pages of a small budget go to the heads that score them highest)", str, GQA_MERGES, configmap=True),
    Setting("pool_tokens", ("engine.paging.pool_tokens",), "KV page pool capacity, tokens, all requests",
            configmap=True),
    Setting("prefix_cache", ("engine.paging.prefix_cache",), "keep finished requests' full KV pages for later "
            "prompts that start with the same tokens (a chat's next turn), evicted when the pool needs room", bool,
            configmap=True),
    Setting("page_size", ("engine.paging.page_size", "engine.selection.page_size"), "page size, tokens"),
    Setting("dtype", ("engine.dtype",), "compute dtype: activations, the KV cache, and the weights under "
            "`--weights auto`", str, DTYPES,
            default_doc="`bfloat16` on a GPU, `float32` on a CPU"),
    Setting("weights", ("engine.weights",), "how linear weights are stored: `auto` (in the compute dtype), `bfloat16`, or "
            "weight-only `int8` (a scale per output channel) / `int4` (a scale and zero per group of inputs); "
            "the narrower formats multiply in bfloat16", str, WEIGHT_FORMATS, configmap=True),
    Setting("allow_extra_weights", ("engine.allow_extra_weights",), "load a checkpoint that holds tensors the model "
            "has no place for, skipping them (refused by default: a wrong or damaged checkpoint)", bool),
    Setting("kv_dtype", ("engine.paging.kv_dtype",), "how KV pages are stored (pool, device slots, stored "
            "contexts): `auto` (the model's dtype), or `int8` / `fp8_e4m3` codes with a scale per token and KV head "
            "(about half the bytes of bf16, a quarter of fp32)", str, KV_DTYPES, configmap=True),
    Setting("tool_format", ("tool_format",), "how the model writes tool calls: `hermes` (`<tool_call>` blocks: Qwen, "
            "Hermes), `llama3` (a bare call object with `parameters`: Llama 3.x), `mistral` (`[TOOL_CALLS]` and a "
            "list), or `auto` (read off the model's chat template; hermes when it shows none)", str, TOOL_FORMATS),
    Setting("tools_shown_when_none", ("tools_shown_when_none",), "show a request's tools under `tool_choice: none` "
            "too (vLLM's default), so that an agent's turns that may not call share one prompt prefix and the prefix "
            "cache holds across them; off, they are left out, which small models need to answer in text rather "
            "than write calls", bool),
    Setting("max_active_requests", ("engine.scheduler.max_active_requests",), "requests batched at once (in prefill or "
            "decode)", configmap=True),
    Setting("max_queued_requests", ("engine.scheduler.max_queued_requests",), "requests waiting; beyond it \"server busy\"",
            least=0),
    Setting("max_queue_wait_s", ("engine.scheduler.max_queue_wait_s",), "seconds a request may wait in the queue "
            "before \"server busy\"", float, least=None),
    Setting("max_step_tokens", ("engine.scheduler.max_step_tokens",), "tokens per engine step (decodes + prompt "
            "chunks)"),
    Setting("prefill_chunk_tokens", ("engine.prefill_chunk_tokens",), "the most prompt tokens of one request in "
            "one step"),
    Setting("max_index_bytes", ("engine.scheduler.max_index_bytes",), "host bytes for the running requests' page "
            "indexes", least=0, configmap=True, default_doc="the pool's size in the model's dtype"),
    Setting("max_device_bytes", ("engine.scheduler.max_device_bytes",), "device bytes the running requests may hold "
            "beside the model, with the pool in host memory (a prefill keeps its prompt's K/V of every layer there)",
            least=0, default_doc="90% of the free device memory after loading"),
    Setting("max_context_bytes", ("engine.scheduler.max_context_bytes",), "host bytes of compressed contexts: "
            "charged to admission, and kept in memory (LRU of unused ones)", least=0,
            default_doc="the pool's size in the model's dtype"),
    Setting("num_threads", ("engine.num_threads",), "threads of the forward pass", default_doc="torch's default"),
    Setting("index_threads", ("engine.index_threads",), "threads building a page index during prefill; 0: after it",
            least=0, default_doc="cores the forward pass leaves free"),
    Setting("search_threads", ("engine.search_threads",), "threads running the page searches of a decode step's "
            "requests in parallel, one request each; 0 or 1: one after another", least=0),
    Setting("store", ("store",), "context store of compressed contexts, shared by replicas: a directory or "
            "`redis://host:port/db`", str, configmap=True, default_doc="none"),
    Setting("prefix_cache_spill", ("prefix_cache_spill",), "write the prefix cache's KV pages to `store` as "
            "they are cached, and read them back when a prompt's pages were evicted or cached by another process "
            "(a restart, a replica over the same store); needs `store`", bool, configmap=True),
    Setting("kv_events_endpoint", ("kv_events_endpoint",), "publish the prefix cache's page events (cached, "
            "evicted) in vLLM's KV-events format on this ZMQ endpoint, for prefix-aware routers (llm-d's KV-cache "
            "indexer, Dynamo's KV router): `tcp://*:5557` binds, `tcp://host:port` connects", str,
            default_doc="none (off)"),
    Setting("kv_events_topic", ("kv_events_topic",), "the topic of those events", str, default_doc="empty"),
    Setting("kv_events_replay_endpoint", ("kv_events_replay_endpoint",), "bind a replay socket here (vLLM's "
            "replay protocol): a subscriber that missed batches asks for them from a sequence number on; "
            "needs `kv_events_endpoint`", str, default_doc="none (off)"),
    Setting("kv_events_replay_batches", ("kv_events_replay_batches",), "event batches kept for replay"),
    Setting("store_max_bytes", ("store_max_bytes",), "context store size limit, bytes", least=0,
            default_doc="8 GiB"),
    Setting("max_compress_tokens", ("compression.max_compress_tokens",), "longest context a request may have the server "
            "compress, tokens", configmap=True),
    Setting("kv2", ("compression.kv2",), "KV² settings for the contexts requests bring, `NAME=VALUE,...` (see "
            "[KV² settings](#kv-settings))", str, configmap=True, default_doc="the method's defaults"),
    Setting("max_cache_retention_s", ("max_cache_retention_s",), "the longest `cache_retention_s` a request may "
            "ask (its prefix kept ahead of the LRU order)", float, least=0),
    Setting("default_max_tokens", ("default_max_tokens",), "`max_tokens` when a request sets none"),
    Setting("max_tokens_limit", ("max_tokens_limit",), "the most `max_tokens` a request may ask"),
)
BY_NAME = {s.name: s for s in SETTINGS}


def choices(setting: Setting) -> tuple[str, ...]:
    """What a setting may be: its own choices, or for ``policy`` the registry's names."""
    return _policy_names() if setting.name == "policy" else setting.choices


def serving_config(params: dict) -> ServingConfig:
    """The ServingConfig of config.pbtxt ``parameters`` (``{key: {"string_value": ...}}`` or plain
    strings; empty ones keep their defaults), checked against the registries (policy, kv2 settings);
    ConfigError naming the parameter otherwise."""
    from icekv.compress import parse_settings
    from icekv.policies import resolve

    texts = {k: (v.get("string_value") if isinstance(v, dict) else v) for k, v in params.items()}
    texts = {k: v for k, v in texts.items() if v not in (None, "")}
    unknown = sorted(set(texts) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown model parameters {unknown}; known: {sorted(BY_NAME)}")
    values = {}
    for name, text in texts.items():
        value = BY_NAME[name].parse(text)
        values.update({path: value for path in BY_NAME[name].fields})
    config = build_config(ServingConfig, values)
    resolve(config.engine.selection)
    parse_settings("kv2", config.compression.kv2)
    return config


def default_parameters() -> dict[str, str]:
    """config.pbtxt parameters that spell out every default with a value (the repository shipped in
    the source tree; ``icekv serve`` overrides some)."""
    return {s.name: str(s.default()).lower() if s.kind is bool else str(s.default())
            for s in SETTINGS if s.default() not in (None, "") and s.name != "model_dir"}


def readme_table() -> str:
    """The README's configuration table (Markdown)."""
    rows = ["| setting | `icekv serve` flag | Triton parameter | ConfigMap key | default |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        listed = choices(s)
        meaning = s.meaning + (f"; one of {', '.join(f'`{c}`' for c in listed)}" if s.name == "policy" else "")
        key = f"`{s.configmap_key}`" if s.configmap else ""
        rows.append(f"| {meaning} | `{s.cli_flag}` | `{s.name}` | {key} | {s.default_doc or _shown(s.default())} |")
    return "\n".join(rows) + "\n"


def _shown(value) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)
