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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from icekv.errors import ConfigError
from icekv.serving.launcher import (ServerError, TritonServer, answers_in_time, free_port, launch,
                                    stop_process_group)
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
    closed: bool = field(default=False, init=False)  # set by close(): a start under way stops what it started

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Replica":
        return self.launch().wait_ready()

    def launch(self) -> "Replica":
        """Starts both processes without waiting for them (see :func:`icekv.serving.launcher.launch`
        for the thread to call from)."""
        logs = {name: self.log_dir / f"replica{self.index}-{name}.log" if self.log_dir else None
                for name in ("triton", "frontend")}
        self.server = TritonServer(self.parameters, http_host="127.0.0.1", log_path=logs["triton"])
        self.frontend = OpenAIFrontendProcess(OpenAIConfig(
            triton_grpc_url=self.server.grpc_url, triton_metrics_url=self.server.metrics_url, port=self.port,
            idle_timeout_s=self.idle_timeout_s, request_timeout_s=self.request_timeout_s), log_path=logs["frontend"])
        return self._stopped_on_failure(lambda part: part.launch(), (self.server, self.frontend))

    def wait_ready(self) -> "Replica":
        """Returns once both answer (the frontend first: it answers without tritonserver, so it is
        not waited on past a failed start of its own); stops both and raises ServerError if one
        does not."""
        return self._stopped_on_failure(lambda part: part.wait_ready(), (self.frontend, self.server))

    def _stopped_on_failure(self, step: Callable, parts: tuple) -> "Replica":
        try:
            for part in parts:
                step(part)
                if self.closed:
                    raise ServerError("the replica set is stopping")
        except BaseException:
            self.stop()
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

    def log_tail(self, n: int = 3) -> str:
        """The last ``n`` lines tritonserver wrote (empty before a start)."""
        return self.server.log_tail(n) if self.server is not None else ""

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        if self.server is not None:
            self.server.stop()

    def close(self) -> None:
        """Stop for good, a start under way included."""
        self.closed = True
        self.stop()


@dataclass
class _Watch:
    """What the supervisor knows of one replica."""

    replica: Replica
    up_since: float  # when it last came up
    delay_s: float = 0.0  # the wait before its last start
    due_at: float | None = None  # stopped, to start at this time
    starting: threading.Thread | None = None  # a start under way
    start_error: str | None = None  # how the last start failed


@dataclass
class ReplicaSupervisor:
    """Starts again each replica whose process exits, on its own port, so that the router's health
    check takes it back once it answers. A replica that stops within ``stable_s`` of coming up (or
    fails to come up) waits twice as long as the last time before its next start
    (``first_delay_s`` up to ``max_delay_s``), as Kubernetes backs off a crash loop; one that ran
    longer starts again after ``first_delay_s``. A start launches the processes on the caller's
    thread (they end with it) and waits for them on a thread of its own, so the caller keeps
    watching the rest and its signals meanwhile."""

    replicas: list[Replica]
    first_delay_s: float = 1.0
    max_delay_s: float = 60.0
    stable_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _watches: list[_Watch] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._watches = [_Watch(replica, self.clock()) for replica in self.replicas]

    def poll(self) -> list[str]:
        """Notice stopped replicas, start those whose wait is over, and see how the starts under
        way ended. Returns what happened, a line each, for the operator."""
        events = []
        for watch in self._watches:
            url, now = watch.replica.url, self.clock()
            if watch.starting is not None:
                if watch.starting.is_alive():
                    continue
                watch.starting = None
                if watch.start_error is None:
                    watch.up_since = now
                    events.append(f"replica {url} started again")
                else:
                    events.append(self._not_started(watch, now))
            elif watch.due_at is None:
                if (why := watch.replica.exited()) is None:
                    continue
                tail = "".join(f"\n  {line}" for line in watch.replica.log_tail().splitlines() if line.strip())
                watch.replica.stop()
                events.append(f"replica {url} stopped ({why}){tail}\nstarting it again in "
                              f"{self._wait(watch, now, soon=now - watch.up_since < self.stable_s):.0f} s")
            elif now >= watch.due_at:
                watch.due_at, watch.start_error = None, None
                self._start(watch, watch.replica.launch)  # on the caller's thread, which its processes end with
                if watch.start_error is not None:  # nothing launched to wait for
                    events.append(self._not_started(watch, now))
                    continue
                watch.starting = threading.Thread(target=self._start, args=(watch, watch.replica.wait_ready),
                                                  daemon=True)
                watch.starting.start()
        return events

    def _not_started(self, watch: _Watch, now: float) -> str:
        """Schedules the next start of a replica whose start failed; the operator's line."""
        return (f"replica {watch.replica.url} did not start ({watch.start_error}); starting it again in "
                f"{self._wait(watch, now, soon=True):.0f} s")

    def _wait(self, watch: _Watch, now: float, soon: bool) -> float:
        """Schedules the replica's next start; returns the wait."""
        watch.delay_s = min(self.max_delay_s, 2 * watch.delay_s or self.first_delay_s) if soon else self.first_delay_s
        watch.due_at = now + watch.delay_s
        return watch.delay_s

    @staticmethod
    def _start(watch: _Watch, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as e:  # ServerError, OSError: reported by the poll that sees it
            watch.start_error = (str(e).splitlines() or [type(e).__name__])[0]

    @property
    def serving(self) -> int:
        """How many replicas are up (neither stopped nor starting)."""
        return sum(w.due_at is None and w.starting is None for w in self._watches)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every replica, the ones starting too."""
        for watch in self._watches:
            watch.replica.close()
        for watch in self._watches:
            if watch.starting is not None:
                watch.starting.join(timeout_s)


@dataclass
class RouterProcess:
    """The SGLang Model Gateway over ``worker_urls``: ``python -m sglang_router launch``.

    Health checks every ``health_check_interval_s`` take a replica that stops answering out of
    the rotation after one miss. A request whose replica cannot be reached is retried, the waits
    doubling from a quarter of that interval (five tries span nearly four intervals), so that a
    request sent to a replica that just died lands on another once the check has seen it. The
    gateway's circuit breaker stays off: it counts a refused request (a 4xx) as a failure of the
    replica, so a client's malformed requests would take healthy replicas out of the rotation."""

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
                "--health-failure-threshold", "1", "--disable-circuit-breaker", "--retry-max-retries", "5",
                "--retry-initial-backoff-ms", str(250 * self.health_check_interval_s),
                "--retry-backoff-multiplier", "2", "--log-level", "warn"]

    def start(self) -> "RouterProcess":
        if importlib.util.find_spec("sglang_router") is None:
            raise ConfigError("--router needs the SGLang Model Gateway: pip install 'icekv[router]' "
                              "(the sglang-router package)")
        self._log = open(self.log_path, "ab+") if self.log_path else tempfile.TemporaryFile()
        self.process = launch(self.command(), self._log)
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
