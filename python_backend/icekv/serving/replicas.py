"""Several icekv servers on one machine behind the SGLang Model Gateway (``icekv serve --replicas N
--router POLICY``).

icekv has no routing logic of its own: each replica is a whole ``icekv serve`` (tritonserver and
its HTTP frontend) on loopback ports, and the gateway (``sglang-router`` on PyPI) picks the replica
for each request, with its cache-aware policy sending a conversation's next turn where its prefix
already is. Replicas over one store (``store`` with ``prefix_cache_spill``) also read each other's
prefix pages, so a turn that lands elsewhere (its replica gone) still skips the stored prefix.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from icekv.errors import ConfigError
from icekv.serving.launcher import ServerError, TritonServer, answers_in_time, free_port, stop_process_group
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.process import OpenAIFrontendProcess

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")  # the gateway's, by its names
ROUTER_STOP_TIMEOUT_S = 10.0


@dataclass
class Replica:
    """One icekv server on loopback, tritonserver and its HTTP frontend, that can be started again
    after it stops: each start makes fresh processes, the frontend on the same ``port`` (the URL
    the router knows it by)."""

    parameters: dict[str, str]
    idle_timeout_s: float
    request_timeout_s: float | None
    log_dir: Path | None = None
    index: int = 0  # names its log files
    port: int = 0  # the frontend's; 0: pick a free one
    server: TritonServer | None = field(default=None, init=False)
    frontend: OpenAIFrontendProcess | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Replica":
        logs = {name: self.log_dir / f"replica{self.index}-{name}.log" if self.log_dir else None
                for name in ("triton", "frontend")}
        self.server = TritonServer(self.parameters, http_host="127.0.0.1", log_path=logs["triton"])
        self.frontend = OpenAIFrontendProcess(OpenAIConfig(
            triton_grpc_url=self.server.grpc_url, triton_metrics_url=self.server.metrics_url, port=self.port,
            idle_timeout_s=self.idle_timeout_s, request_timeout_s=self.request_timeout_s), log_path=logs["frontend"])
        self.server.start()
        try:
            self.frontend.start()
        except BaseException:
            self.server.stop()
            raise
        return self

    def exited(self) -> str | None:
        """Why it is not serving (a message), None while both processes run."""
        for name, part in (("tritonserver", self.server), ("the HTTP frontend", self.frontend)):
            process = part.process if part is not None else None
            if process is None:
                return f"{name} is not running"
            if process.poll() is not None:
                return f"{name} exited with {process.returncode}"
        return None

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        if self.server is not None:
            self.server.stop()


@dataclass
class ReplicaSupervisor:
    """Starts again each replica whose process exits, on its own port, so that the router's health
    check takes it back once it answers. A replica that stops within ``stable_s`` of its start
    waits twice as long as the last time before the next start (``first_delay_s`` up to
    ``max_delay_s``), as Kubernetes backs off a crash loop; one that ran longer starts again after
    ``first_delay_s``."""

    replicas: list[Replica]
    first_delay_s: float = 1.0
    max_delay_s: float = 60.0
    stable_s: float = 60.0
    _started_at: list[float] = field(default_factory=list, init=False)
    _delay_s: list[float] = field(default_factory=list, init=False)
    _due_at: list[float | None] = field(default_factory=list, init=False)  # None: running

    def __post_init__(self) -> None:
        now = time.monotonic()
        self._started_at = [now for _ in self.replicas]
        self._delay_s = [0.0 for _ in self.replicas]
        self._due_at = [None for _ in self.replicas]

    def poll(self, now: float | None = None) -> list[str]:
        """Notice stopped replicas and start those whose wait is over (a start blocks until the
        replica answers or fails). Returns what happened, a line each, for the operator."""
        now = time.monotonic() if now is None else now
        events = []
        for i, replica in enumerate(self.replicas):
            if self._due_at[i] is None:
                if (why := replica.exited()) is None:
                    continue
                crashed_soon = now - self._started_at[i] < self.stable_s
                self._delay_s[i] = (min(self.max_delay_s, 2 * self._delay_s[i] or self.first_delay_s)
                                    if crashed_soon else self.first_delay_s)
                self._due_at[i] = now + self._delay_s[i]
                replica.stop()
                events.append(f"replica {replica.url} stopped ({why}); starting it again in "
                              f"{self._delay_s[i]:.0f} s")
            elif now >= self._due_at[i]:
                self._due_at[i], self._started_at[i] = None, now
                try:
                    replica.start()
                    events.append(f"replica {replica.url} started again")
                except (ServerError, OSError) as e:  # seen as stopped at the next poll
                    events.append(f"replica {replica.url} did not start: {str(e).splitlines()[0]}")
        return events

    @property
    def serving(self) -> int:
        """How many replicas are up (started and not seen stopped)."""
        return sum(due is None for due in self._due_at)


@dataclass
class RouterProcess:
    """The SGLang Model Gateway over ``worker_urls``: ``python -m sglang_router launch``.

    Health checks every ``health_check_interval_s`` take a replica that stops answering out of
    the rotation after one miss, and its first failed request opens its circuit: the gateway
    sends that request, and the next ones, to another replica."""

    worker_urls: tuple[str, ...]
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    log_path: Path | None = None
    health_check_interval_s: int = 1
    startup_timeout_s: float = 60.0
    process: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ConfigError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if not self.worker_urls:
            raise ConfigError("a router needs at least one replica")
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router", "launch", "--worker-urls", *self.worker_urls,
                "--policy", self.policy, "--host", self.host, "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--health-check-endpoint", "/health", "--health-check-interval-secs", str(self.health_check_interval_s),
                "--health-failure-threshold", "1", "--cb-failure-threshold", "1", "--log-level", "warn"]

    def start(self) -> "RouterProcess":
        if importlib.util.find_spec("sglang_router") is None:
            raise ConfigError("--router needs the SGLang Model Gateway: pip install 'icekv[router]' "
                              "(the sglang-router package)")
        self._log = open(self.log_path, "ab+") if self.log_path else tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        if answers_in_time(self.process, f"{self.url}/readiness", self.startup_timeout_s,
                           lambda: f"the router exited with {self.process.returncode}:\n{self.log_tail()}"):
            return self
        self.stop()
        raise ServerError(f"the router was not ready on {self.url} within {self.startup_timeout_s:.0f} s")

    def log_tail(self, n: int = 10) -> str:
        """The last ``n`` lines the router wrote, without its colour codes."""
        self._log.flush()
        self._log.seek(0)
        text = re.sub(r"\x1b\[[0-9;]*m", "", self._log.read().decode(errors="replace"))
        return "\n".join(text.splitlines()[-n:])

    def stop(self, timeout_s: float = ROUTER_STOP_TIMEOUT_S) -> None:
        stop_process_group(self.process, timeout_s)
        if getattr(self, "_log", None):
            self._log.close()
