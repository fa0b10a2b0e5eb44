"""The HTTP frontend's settings (``icekv serve`` fills them from its flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from icekv.config.serving import ServingConfig
from icekv.errors import ConfigError


@dataclass(frozen=True)
class OpenAIConfig:
    """icekv's HTTP frontend (the OpenAI API and Triton's generate extension): where it listens,
    which Triton model it forwards to, its limits."""

    triton_grpc_url: str = "127.0.0.1:8001"
    triton_metrics_url: str | None = None  # Triton's /metrics, served again at this frontend's /metrics; None: no route
    model: str = "icekv"  # the Triton model, and the model id clients name
    host: str = "127.0.0.1"
    port: int = 9000
    extra_ports: tuple[int, ...] = ()  # more ports serving the same routes (icekv serve: the HTTP port)
    max_body_bytes: int = 4 << 20  # larger bodies get a 413 before they are read
    max_stop_sequences: int = ServingConfig.max_stop_sequences  # the model's own limit
    idle_timeout_s: float = 600.0  # the longest wait for a request's next piece (its first: queue and prefill)
    request_timeout_s: float | None = None  # a whole request's limit; None: none, a reply runs while pieces come

    def __post_init__(self) -> None:
        for port in (self.port, *self.extra_ports):
            if not (1 <= port <= 65535):
                raise ConfigError(f"port must be in 1..65535, got {port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_stop_sequences < 0:
            raise ConfigError(f"max_stop_sequences must be >= 0, got {self.max_stop_sequences}")
        for name in ("idle_timeout_s", "request_timeout_s"):
            checked_timeout(name, getattr(self, name))


def checked_timeout(name: str, value: float | None) -> float | None:
    """The rule for a timeout: a positive, finite number of seconds, or None (no limit)."""
    if value is not None and not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
    return value
