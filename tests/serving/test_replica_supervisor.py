"""ReplicaSupervisor's rule, over stand-in replicas and a stand-in clock (the real processes are
restarted in test_replicas.py): a replica that stops is started again after a wait that doubles
while it keeps stopping soon after coming up (or fails to come up), and starts from the first wait
again once it has run stably; a start launches on the polling thread and waits beside the polls;
closing stops a start under way."""

import threading
import time

from icekv.serving.launcher import ServerError
from icekv.serving.replicas import ReplicaSupervisor


class StandIn:
    """What the supervisor calls on a replica. ``fails``: how many starts raise; ``gate``: a start
    waits for it (a slow model load)."""

    def __init__(self, url: str, fails: int = 0, gate: threading.Event | None = None, launch_fails: int = 0):
        self.url, self.fails, self.gate, self.launch_fails = url, fails, gate, launch_fails
        self.up, self.starts, self.closed, self.launched_on = True, 0, False, None

    def exited(self):
        return None if self.up else "tritonserver exited with -9"

    def log_tail(self):
        return "E1206 the last line\n"

    def stop(self):
        self.up = False

    def close(self):
        self.closed = True
        self.stop()
        if self.gate is not None:
            self.gate.set()

    def launch(self):
        self.starts += 1
        self.launched_on = threading.current_thread()  # its processes end with this thread
        if self.launch_fails:
            self.launch_fails -= 1
            raise ServerError("no tritonserver found")
        return self

    def wait_ready(self):
        if self.gate is not None:
            self.gate.wait(10)
        if self.fails or self.closed:
            self.fails = max(self.fails - 1, 0)
            raise ServerError("tritonserver not ready after 300 s:\nlog")
        self.up = True
        return self


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _settle(supervisor) -> list[str]:
    """Poll until the starts under way have ended and been seen."""
    events = supervisor.poll()
    while any(w.starting is not None for w in supervisor._watches):
        time.sleep(0.01)
        events += supervisor.poll()
    return events


def test_a_stopped_replica_waits_then_starts_again():
    a, b, clock = StandIn("http://a"), StandIn("http://b"), Clock()
    supervisor = ReplicaSupervisor([a, b], first_delay_s=1.0, max_delay_s=8.0, stable_s=60.0, clock=clock)
    clock.now += 100
    assert supervisor.poll() == [] and supervisor.serving == 2
    a.up = False
    assert supervisor.poll() == ["replica http://a stopped (tritonserver exited with -9)\n  E1206 the last line\n"
                                 "starting it again in 1 s"]
    assert supervisor.serving == 1 and a.starts == 0
    clock.now += 0.5
    assert supervisor.poll() == [] and a.starts == 0  # still waiting
    clock.now += 0.5
    assert _settle(supervisor) == ["replica http://a started again"] and supervisor.serving == 2
    assert a.starts == 1 and b.starts == 0
    assert a.launched_on is threading.current_thread()  # not the start's own thread, which ends


def test_a_crash_loop_backs_off_up_to_the_cap_and_a_stable_run_resets_it():
    a, clock = StandIn("http://a"), Clock()
    supervisor = ReplicaSupervisor([a], first_delay_s=1.0, max_delay_s=4.0, stable_s=60.0, clock=clock)
    waits = []
    for _ in range(5):  # it stops a second after each start
        clock.now += 1
        a.up = False
        supervisor.poll()
        waits.append(supervisor._watches[0].delay_s)
        clock.now += waits[-1]
        assert _settle(supervisor)[-1] == "replica http://a started again"
    assert waits == [1, 2, 4, 4, 4]
    clock.now += 120  # a stable run
    a.up = False
    assert supervisor.poll()[0].endswith("starting it again in 1 s")


def test_a_start_that_fails_counts_as_a_stop_soon_after_coming_up():
    a, clock = StandIn("http://a", fails=1), Clock()
    supervisor = ReplicaSupervisor([a], first_delay_s=1.0, stable_s=60.0, clock=clock)
    clock.now += 100
    a.up = False
    supervisor.poll()
    clock.now += 1
    assert _settle(supervisor) == ["replica http://a did not start (tritonserver not ready after 300 s:); "
                                   "starting it again in 2 s"]
    assert supervisor.serving == 0
    clock.now += 2
    assert _settle(supervisor) == ["replica http://a started again"] and a.starts == 2


def test_a_slow_start_runs_beside_the_polls_and_closing_stops_it():
    gate, clock = threading.Event(), Clock()
    a, b = StandIn("http://a", gate=gate), StandIn("http://b")
    supervisor = ReplicaSupervisor([a, b], first_delay_s=0.0, clock=clock)
    a.up = False
    supervisor.poll()
    supervisor.poll()  # a's start begins, and waits on the gate
    b.up = False
    assert supervisor.poll()[0].startswith("replica http://b stopped")  # b is watched meanwhile
    assert supervisor.serving == 0
    supervisor.close(timeout_s=10)
    assert a.closed and b.closed and not a.up
    assert not supervisor._watches[0].starting.is_alive()


def test_a_launch_that_fails_is_reported_at_once_and_tried_again_later():
    a, clock = StandIn("http://a", launch_fails=1), Clock()
    supervisor = ReplicaSupervisor([a], first_delay_s=1.0, stable_s=60.0, clock=clock)
    clock.now += 100
    a.up = False
    supervisor.poll()
    clock.now += 1
    assert supervisor.poll() == ["replica http://a did not start (no tritonserver found); starting it again in 2 s"]
    assert supervisor._watches[0].starting is None and supervisor.serving == 0
    clock.now += 2
    assert _settle(supervisor) == ["replica http://a started again"] and a.starts == 2 and a.up
