"""The serving engine thread survives its own bugs: a failure in its handling fails the requests in
flight and the next ones are served; if even that fails, every waiting client is told and new
requests are refused (real engine, real model)."""

import pytest

from icekv.config.engine import EngineConfig, SchedulerConfig
from icekv.config.request import SamplingConfig
from icekv.config.selection import SelectionConfig
from icekv.engine import Engine
from icekv.serving.engine_loop import EngineLoop, EngineStopped
from icekv.serving.request import GenerateRequest
from tests.serving.sinks import RecordingSink

pytestmark = pytest.mark.model


def _request(max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest("The capital of France is", SamplingConfig(max_tokens=max_tokens),
                           SelectionConfig(policy="full"), stream=True, context_key=None)


@pytest.fixture
def loop(smollm2_dir):
    made = EngineLoop(lambda: Engine(EngineConfig(model_dir=str(smollm2_dir), scheduler=SchedulerConfig(max_active_requests=2))))
    yield made
    made.stop()


def _broken_once_while_running(loop, method):
    failed = []

    def broken(*args, **kwargs):
        if loop.engine.scheduler.running and not failed:
            failed.append(True)
            raise RuntimeError("a bug in the loop's bookkeeping")
        return method(*args, **kwargs)
    return broken


def test_a_failure_in_the_loop_fails_the_requests_in_flight_and_serving_goes_on(loop, monkeypatch):
    monkeypatch.setattr(loop, "_count", _broken_once_while_running(loop, loop._count))
    first = RecordingSink(loop)
    loop.submit(_request(max_tokens=40), first)
    assert first.finished.wait(120)
    assert first.failure is not None and first.failure[0] == "internal"
    second = RecordingSink(loop)
    loop.submit(_request(), second)
    assert second.finished.wait(120)
    assert second.failure is None and second.result.text.strip().startswith("Paris")
    assert loop.alive and loop.engine.cache.pages_available == loop.engine.cache.allocator.num_pages


def test_a_loop_that_cannot_recover_tells_every_client_and_refuses_new_requests(loop, monkeypatch):
    def always_broken(*args, **kwargs):
        raise RuntimeError("broken beyond repair")

    monkeypatch.setattr(loop, "_count", always_broken)
    monkeypatch.setattr(loop, "_fail_all", always_broken)
    waiting = RecordingSink(loop)
    loop.submit(_request(max_tokens=40), waiting)
    assert waiting.finished.wait(120)
    assert waiting.failure == ("internal", "internal error: the engine stopped")
    assert not loop.alive
    with pytest.raises(EngineStopped, match="the engine stopped"):
        loop.check_accepting()
    with pytest.raises(EngineStopped):
        loop.submit(_request(), RecordingSink(loop))


def test_one_mapping_from_error_to_what_the_client_is_told():
    import json

    from icekv.engine import BusyError, Cancelled
    from icekv.errors import ConfigError
    from icekv.serving.error_kinds import kind_of, tag
    from icekv.serving.loop_api import error_reply

    cases = {Cancelled("gone"): "cancelled", BusyError("server busy: full"): "busy",
             EngineStopped("internal error: stopped"): "internal", ConfigError("budget must be >= 1"): "client",
             json.JSONDecodeError("bad", "{", 0): "client", KeyError("a bug"): "internal"}
    for error, kind in cases.items():
        message, got = error_reply(error)
        assert got == kind, error
        assert kind_of(tag(message, got)) == kind  # what the HTTP frontend reads back
    assert "a bug" not in error_reply(KeyError("a bug"))[0]  # an internal error's details stay in the log
    assert kind_of("Stub process 'icekv_0_0' is not healthy.") == "busy"  # Triton's, not the client's fault
