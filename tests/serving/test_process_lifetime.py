"""A process icekv launches ends with the thread that launched it (Linux's parent-death signal):
a launcher killed by SIGKILL leaves no server running on its own."""

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")

# a launcher as icekv serve is one: SIGTERM caught (its children inherit the handler until they exec)
LAUNCHER = """
import signal, subprocess, sys, threading
from icekv.serving.launcher import launch

signal.signal(signal.SIGTERM, lambda *_: None)
on_thread = threading.Thread(target=lambda: print(launch(["sleep", "60"], subprocess.DEVNULL).pid, flush=True))
on_thread.start()
on_thread.join()
print(launch(["sleep", "60"], subprocess.DEVNULL).pid, flush=True)
threading.Event().wait()
"""


def _state(pid: int) -> str:
    try:
        return next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("State"))
    except FileNotFoundError:
        return "gone"


def _ends_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _state(pid) not in ("Z", "gone") and time.monotonic() < deadline:
        time.sleep(0.05)
    return _state(pid) in ("Z", "gone")  # a zombie until its parent (or init) reaps it


def test_a_launched_process_ends_with_the_thread_that_launched_it():
    """A child launched from a thread that ends is sent SIGTERM then (why the replica supervisor
    launches on its own thread); one launched from the main thread, when the launcher is killed."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        from_thread, from_main = int(launcher.stdout.readline()), int(launcher.stdout.readline())
        assert _ends_within(from_thread, 10)
        assert _state(from_main) not in ("Z", "gone")
        launcher.kill()
        assert _ends_within(from_main, 10)
    finally:
        launcher.kill()
        launcher.wait()
