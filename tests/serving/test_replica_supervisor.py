"""ReplicaSupervisor's rule, over stand-in replicas (the real processes are restarted in
test_replicas.py): a replica that stops is started again after a wait that doubles while it keeps
stopping soon after its start, and starts from the first wait again once it has run stably."""

from icekv.serving.launcher import ServerError
from icekv.serving.replicas import ReplicaSupervisor


class StandIn:
    """What the supervisor calls on a replica; ``fails`` starts raise as a server that never answers."""

    def __init__(self, url: str, fails: int = 0):
        self.url, self.fails, self.up, self.starts = url, fails, True, 0

    def exited(self):
        return None if self.up else "tritonserver exited with -9"

    def stop(self):
        self.up = False

    def start(self):
        self.starts += 1
        if self.fails:
            self.fails -= 1
            raise ServerError("tritonserver not ready after 300 s:\nlog")
        self.up = True
        return self


def test_a_stopped_replica_waits_then_starts_again():
    a, b = StandIn("http://a"), StandIn("http://b")
    supervisor = ReplicaSupervisor([a, b], first_delay_s=1.0, max_delay_s=8.0, stable_s=60.0)
    assert supervisor.poll(now=1e9) == [] and supervisor.serving == 2
    a.up = False
    assert supervisor.poll(now=1e9) == ["replica http://a stopped (tritonserver exited with -9); starting it again in 1 s"]
    assert supervisor.serving == 1 and a.starts == 0
    assert supervisor.poll(now=1e9 + 0.5) == [] and a.starts == 0  # still waiting
    assert supervisor.poll(now=1e9 + 1) == ["replica http://a started again"] and supervisor.serving == 2
    assert b.starts == 0


def test_a_crash_loop_backs_off_up_to_the_cap_and_a_stable_run_resets_it():
    a = StandIn("http://a")
    supervisor = ReplicaSupervisor([a], first_delay_s=1.0, max_delay_s=4.0, stable_s=60.0)
    now, waits = supervisor._started_at[0] + 1, []
    for _ in range(5):  # it stops a second after each start
        a.up = False
        event = supervisor.poll(now)[0]
        waits.append(float(event.rsplit("in ", 1)[1].split()[0]))
        now += waits[-1]
        assert supervisor.poll(now) == ["replica http://a started again"]
        now += 1
    assert waits == [1, 2, 4, 4, 4]
    now += 120  # a stable run
    a.up = False
    assert supervisor.poll(now)[0].endswith("starting it again in 1 s")


def test_a_start_that_fails_counts_as_a_stop_soon_after_starting():
    a = StandIn("http://a", fails=1)
    supervisor = ReplicaSupervisor([a], first_delay_s=1.0, stable_s=60.0)
    a.up = False
    supervisor.poll(now=1e9)
    assert supervisor.poll(now=1e9 + 1) == ["replica http://a did not start: tritonserver not ready after 300 s:"]
    assert supervisor.poll(now=1e9 + 1.1)[0].endswith("starting it again in 2 s")
    assert supervisor.poll(now=1e9 + 3.1) == ["replica http://a started again"] and a.starts == 2
