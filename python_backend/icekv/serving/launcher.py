"""Start a real tritonserver with the icekv model: find the binary, prepare backend and env, wait.

Works with the server bundled in the ``nvidia-pytriton`` wheel (CPU machines, CI) and with an NGC
image's ``/opt/tritonserver``. The Python backend's stub runs ``model.py`` with the first
``python3`` on ``PATH``, so the current interpreter's ``bin`` goes first.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from icekv.errors import IcekvError
from icekv.serving.repository import write_model_repository

NGC_ROOT = Path("/opt/tritonserver")


class ServerError(IcekvError):
    """tritonserver could not be found, started or reached."""


# Triton APIs closed to clients without the admin header: model configs (local paths, settings),
# shared-memory registration, repository control, statistics, trace and log settings.
RESTRICTED_APIS = "model-config,shared-memory,model-repository,statistics,trace,logging"
ADMIN_HEADER = "icekv-admin-key"
ADMIN_KEY_FILE_ENV = "ICEKV_ADMIN_KEY_FILE"  # a mounted secret; without it a random key (admin APIs unusable)
EXIT_TIMEOUT_S = 30  # Triton's own wait for in-flight requests and the model's unload at shutdown
STOP_TIMEOUT_S = EXIT_TIMEOUT_S + 10  # then the launcher kills it (the pod's grace period must exceed this)


PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal for this process when its launching thread ends


def launch(command: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` started as the leader of a process group of its own (:func:`stop_process_group`
    stops it whole), its output to ``log``. On Linux it is sent SIGTERM when the thread that
    launched it ends, so a launcher that dies, even by SIGKILL, leaves no server running on its
    own: launch from a thread that lasts as long as the process should (the main thread, or the
    caller's loop)."""
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_terminated_with(os.getpid()) if sys.platform == "linux" else None)


def _terminated_with(launcher: int) -> Callable[[], None]:
    """The child's first step after the fork: SIGTERM back to its default (a launcher's Python
    handler, inherited until the exec, would catch it), asked for at its launcher's end, and taken
    now if the launcher has already gone (then nothing else will send it)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]

    def arm() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def stop_process_group(process: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM to the process group ``process`` leads, SIGKILL if it outlives ``timeout_s``; then
    SIGKILL to whatever is left of the group (a crashed tritonserver leaves its Python stubs)."""
    if process is None:
        return
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    process.wait()


def answers_in_time(process: subprocess.Popen, url: str, timeout_s: float, exited: Callable[[], str],
                    poll_s: float = 0.2) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s`` while ``process`` starts; ServerError with
    ``exited()`` if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(exited())
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(poll_s)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...] = ()

    @classmethod
    def find(cls, work_dir: Path) -> "TritonInstall":
        """The NGC install if present, else the pytriton wheel's (its backend copied to work_dir)."""
        if (NGC_ROOT / "bin" / "tritonserver").is_file():
            return cls(NGC_ROOT / "bin" / "tritonserver", NGC_ROOT / "backends")
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise ServerError("no tritonserver: install nvidia-pytriton==0.7.0 (make setup) or use an NGC Triton image")
        root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerError(f"the pytriton wheel has no Python backend stub for Python {py}")
        backend = work_dir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for src in (root / "backends/python/libtriton_python.so", root / "backends/python/triton_python_backend_utils.py", stub):
            shutil.copy2(src, backend / src.name)
        _warn_if_stub_python_differs(stub)
        libs = root.parent.parent / "nvidia_pytriton.libs"
        return cls(root / "bin" / "tritonserver", work_dir / "backends", (libs,) if libs.is_dir() else ())


def _warn_if_stub_python_differs(stub: Path) -> None:
    """The wheel's stub embeds the system's libpython but imports the standard library of the
    Python on PATH (this venv's base); when those differ, C modules such as ``_ssl`` fail to load
    in the model (Redis needs them). Say so before the model fails."""
    try:
        linked = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return
    system = [line.split("=>")[1].split()[0] for line in linked.splitlines()
              if "libpython" in line and "=>" in line and line.split("=>")[1].strip().startswith(("/lib", "/usr/lib"))]
    if system and os.path.realpath(sys.base_prefix) != "/usr":
        warnings.warn(f"Triton's Python stub runs on the system's {system[0]}, but this environment is built on "
                      f"{sys.base_prefix} (Python {sys.version.split()[0]}): the model may fail to import C modules "
                      "of the standard library (ssl, needed for Redis). Create the venv with the system's python3 "
                      f"(/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}), as `make setup` does.",
                      stacklevel=3)


@dataclass
class TritonServer:
    """A tritonserver process serving icekv; use as a context manager or call start()/stop()."""

    parameters: dict[str, str] = field(default_factory=dict)  # config.pbtxt parameter overrides
    model_repository: Path | None = None  # None: write one into the work dir
    host: str = "127.0.0.1"
    http_host: str | None = None  # where Triton's own HTTP listens (None: host); icekv serve: loopback
    http_port: int = 0  # 0: pick a free port
    grpc_port: int = 0
    metrics_port: int = 0
    startup_timeout_s: float = 300.0
    log_path: Path | None = None
    admin_key: str | None = None  # header value that opens the admin APIs; None: $ICEKV_ADMIN_KEY_FILE or random
    process: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.admin_key is None:
            path = os.environ.get(ADMIN_KEY_FILE_ENV)
            self.admin_key = Path(path).read_text().strip() if path else secrets.token_hex(16)
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        self._work = Path(tempfile.mkdtemp(prefix="icekv-triton-"))

    @property
    def http_url(self) -> str:
        return f"{self.http_host or self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall, repo: Path) -> list[str]:
        return [
            str(install.binary), f"--model-repository={repo}", f"--backend-directory={install.backend_dir}",
            f"--http-address={self.http_host or self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--exit-on-error=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--log-verbose=0",
            # clients reach inference, health and metadata; the rest only with the admin header
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={self.admin_key}",
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        libs = [str(p) for p in install.lib_dirs] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else [])
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        return env

    def start(self) -> "TritonServer":
        return self.launch().wait_ready()

    def launch(self) -> "TritonServer":
        """Starts tritonserver without waiting for it (see :func:`icekv.serving.launcher.launch` for
        the thread to call from)."""
        install = TritonInstall.find(self._work)
        repo = self.model_repository or write_model_repository(self._work / "models", self.parameters)
        log_path = self.log_path or self._work / "tritonserver.log"
        self._log = open(log_path, "ab")  # a restarted server's log follows its predecessor's
        self.process = launch(self.command(install, repo), self._log, self.environment(install))
        self.log_path = log_path
        return self

    def wait_ready(self) -> "TritonServer":
        """Returns once the launched server is ready; stops it and raises ServerError if it is not in time."""
        if answers_in_time(self.process, f"http://{self.http_url}/v2/health/ready", self.startup_timeout_s,
                           lambda: f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}", 0.5):
            return self
        self.stop()
        raise ServerError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (Triton drains and unloads the model), then SIGKILL if it hangs."""
        stop_process_group(self.process, timeout_s)
        if getattr(self, "_log", None):
            self._log.close()
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
