"""The OpenAI frontend as a child process next to tritonserver (what ``icekv serve --openai-port`` runs)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.launcher import ServerError, answers_in_time, launch, stop_process_group


FRONTEND_STOP_TIMEOUT_S = 10.0  # then it is killed; icekv serve stops it before tritonserver


@dataclass
class OpenAIFrontendProcess:
    """``python -m icekv.serving.openai`` with ``config``; a context manager, or start()/stop()."""

    config: OpenAIConfig
    log_path: Path | None = None
    startup_timeout_s: float = 60.0
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def command(self) -> list[str]:
        c = self.config
        return [sys.executable, "-m", "icekv.serving.openai", f"--triton-grpc-url={c.triton_grpc_url}",
                f"--model={c.model}", f"--host={c.host}", f"--port={c.port}", f"--max-body-bytes={c.max_body_bytes}",
                f"--idle-timeout-s={c.idle_timeout_s}", *(f"--extra-port={p}" for p in c.extra_ports),
                *([f"--request-timeout-s={c.request_timeout_s}"] if c.request_timeout_s is not None else []),
                *([f"--triton-metrics-url={c.triton_metrics_url}"] if c.triton_metrics_url is not None else [])]

    def start(self) -> "OpenAIFrontendProcess":
        return self.launch().wait_ready()

    def launch(self) -> "OpenAIFrontendProcess":
        """Starts the frontend without waiting for it (see :func:`icekv.serving.launcher.launch`)."""
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = launch(self.command(), self._log)
        return self

    def wait_ready(self) -> "OpenAIFrontendProcess":
        """Returns once it answers; stops it and raises ServerError if it does not in time."""
        exited = lambda: (f"the OpenAI frontend exited with {self.process.returncode}"  # noqa: E731
                          + (f" (log: {self.log_path})" if self.log_path else ""))
        if answers_in_time(self.process, f"{self.url}/v1/models", self.startup_timeout_s, exited):
            return self
        self.stop()
        raise ServerError(f"the OpenAI frontend did not answer on {self.url} within {self.startup_timeout_s:.0f} s")

    def stop(self, timeout_s: float = FRONTEND_STOP_TIMEOUT_S) -> None:
        stop_process_group(self.process, timeout_s)
        if self.log_path and getattr(self, "_log", None):
            self._log.close()

    def __enter__(self) -> "OpenAIFrontendProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
