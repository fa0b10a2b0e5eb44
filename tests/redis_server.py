"""A real redis-server on loopback for the tests (Debian's package; .ci/run installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def start_redis(directory: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A new redis-server (no persistence, ``args`` added), ready: its process and URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (.ci/run installs Debian's redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory), *args], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, f"redis://127.0.0.1:{port}/0"
