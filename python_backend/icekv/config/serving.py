"""The server's settings: the engine plus request admission limits, the context store and the
compression of the contexts requests bring."""

from __future__ import annotations

from dataclasses import dataclass, field

from icekv.config.engine import EngineConfig
from icekv.errors import ConfigError


def check_kv_budget(value: float, name: str = "kv_budget") -> None:
    """A share of a context's KV to keep must be in (0, 1] (ConfigError naming ``name`` otherwise)."""
    if not (0 < value <= 1):
        raise ConfigError(f"{name} must be in (0, 1], got {value:g}")


@dataclass(frozen=True)
class CompressionConfig:
    """Compressing reusable contexts (``icekv compress``, and the server's ``context`` requests)."""

    method: str = "kv2"
    kv_budget: float = 0.05  # share of the context's KV kept
    max_compress_tokens: int = 32768  # the longest context the server compresses
    kv2: str = ""  # the kv2 method's settings, "NAME=VALUE,..." (its dataclass fields; empty: its defaults)

    def __post_init__(self) -> None:
        check_kv_budget(self.kv_budget)
        if self.max_compress_tokens < 1:
            raise ConfigError(f"max_compress_tokens must be >= 1, got {self.max_compress_tokens}")


TOOL_FORMATS = ("auto", "hermes", "llama3", "mistral")  # icekv.serving.tool_formats


ZMQ_TRANSPORTS = ("tcp://", "ipc://")  # ones another process reaches


@dataclass(frozen=True)
class ServingConfig:
    """The Triton model's settings: the engine plus request admission limits.

    Filled from the ``parameters`` of ``config.pbtxt`` by :func:`icekv.config.settings.serving_config`;
    its engine's defaults are the library's own (one default per setting).
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    default_max_tokens: int = 128
    max_tokens_limit: int = 4096
    store: str | None = None  # context store: a directory or redis://host:port; None: no store
    store_max_bytes: int = 8 << 30
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    max_stop_sequences: int = 4  # stop strings per request, as the OpenAI API allows ...
    max_stop_chars: int = 128  # ... and each one's length: every token is checked against them
    max_input_bytes: int = 4 << 20  # text_input, messages or context: larger ones are refused before tokenizing
    max_cache_retention_s: float = 600.0  # the longest cache_retention_s a request may ask
    prefix_cache_spill: bool = False  # the prefix cache's pages also written to the store, read back on a miss
    kv_events_endpoint: str | None = None  # ZMQ endpoint of the prefix cache's page events (vLLM's format); None: off
    kv_events_topic: str = ""  # their topic
    kv_events_replay_endpoint: str | None = None  # ZMQ endpoint replaying missed event batches (bound); None: off
    kv_events_replay_batches: int = 10_000  # event batches kept for replay (vLLM's buffer_steps)
    tool_format: str = "auto"  # TOOL_FORMATS: how the model writes tool calls (auto: read off its chat template)
    tools_shown_when_none: bool = False  # tool_choice none still shows the tools (the prompt its conversation shares)

    def __post_init__(self) -> None:
        if self.tool_format not in TOOL_FORMATS:
            raise ConfigError(f"tool_format must be one of {', '.join(TOOL_FORMATS)}, got {self.tool_format!r}")
        if self.prefix_cache_spill and not self.store:
            raise ConfigError("prefix_cache_spill needs a store (store: a directory or redis://...)")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith(ZMQ_TRANSPORTS):
            raise ConfigError(f"kv_events_endpoint must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH), "
                              f"got {self.kv_events_endpoint!r}")
        if self.kv_events_replay_endpoint is not None:
            if not self.kv_events_endpoint:
                raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint (the events it replays)")
            if not self.kv_events_replay_endpoint.startswith(ZMQ_TRANSPORTS):
                raise ConfigError(f"kv_events_replay_endpoint must be a ZMQ endpoint to bind (tcp://*:PORT, "
                                  f"ipc://PATH), got {self.kv_events_replay_endpoint!r}")
        for name in ("prefix_cache_spill", "kv_events_endpoint"):
            if getattr(self, name) and not self.engine.paging.prefix_cache:
                raise ConfigError(f"{name} needs the prefix cache (prefix_cache true)")
        if not (1 <= self.default_max_tokens <= self.max_tokens_limit):
            raise ConfigError("default_max_tokens must be in 1..max_tokens_limit")
