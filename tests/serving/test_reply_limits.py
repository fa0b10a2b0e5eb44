"""Long replies through the HTTP frontend: a reply runs for as long as its pieces keep coming
(``idle_timeout_s`` between two of them), a stalled engine is cut with a clear error and its
request cancelled, and a whole-request limit applies only where one is set. The engine stalls
for real: the model's Python stub process is stopped (SIGSTOP) and resumed."""

import json
import os
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from icekv.serving.launcher import free_port
from icekv.serving.openai.config import OpenAIConfig
from icekv.serving.openai.process import OpenAIFrontendProcess
from tests.serving.conftest import metrics, stub_pids, wait_idle

IDLE_S = 4.0  # the frontends' idle limit here (a first piece on a busy machine takes seconds)
TOTAL_S = 2.0  # and the whole-request limit of the second one
STORY = [{"role": "user", "content": "Write a very long story about a dragon."}]


@contextmanager
def engine_stopped(server):
    """The model's stub processes stopped for the block: no step runs, no piece leaves."""
    pids = [int(pid) for pid in stub_pids(server)]
    assert pids, "no Python stub found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def idle_limited(server):
    config = OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port(), idle_timeout_s=IDLE_S)
    assert config.request_timeout_s is None  # no whole-request limit unless one is set
    with OpenAIFrontendProcess(config) as frontend:
        yield frontend


@pytest.fixture(scope="module")
def total_limited(server):
    config = OpenAIConfig(triton_grpc_url=server.grpc_url, port=free_port(), request_timeout_s=TOTAL_S)
    with OpenAIFrontendProcess(config) as frontend:
        yield frontend


def client_of(frontend):
    import openai
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_reply_longer_than_the_idle_limit_completes_while_its_pieces_keep_coming(idle_limited, server):
    stream = client_of(idle_limited).chat.completions.create(model="icekv", messages=STORY, max_tokens=400,
                                                             stream=True)
    pieces = iter(stream)
    arrivals, chunks, fresh = [time.monotonic()], [next(pieces)], threading.Event()

    def stall_twice():  # each stall shorter than the idle limit, each after a new piece (still generating)
        for _ in range(2):
            fresh.clear()
            fresh.wait(timeout=60)
            with engine_stopped(server):
                time.sleep(0.5 * IDLE_S)

    staller = threading.Thread(target=stall_twice)
    staller.start()
    for chunk in pieces:
        arrivals.append(time.monotonic())
        chunks.append(chunk)
        fresh.set()
    staller.join()
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
    assert gaps[-2] > 0.4 * IDLE_S  # the client waited through both stalls
    assert arrivals[-1] - arrivals[0] > IDLE_S  # the reply outlasted the limit
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) > 20  # every piece came through


def test_a_stalled_engine_is_cut_with_a_clear_error_and_its_request_cancelled(idle_limited, server):
    import openai

    before = wait_idle(server)["icekv_requests_cancelled_total"]
    stream = client_of(idle_limited).chat.completions.create(model="icekv", messages=STORY, max_tokens=1000,
                                                             stream=True)
    pieces = iter(stream)
    next(pieces), next(pieces)  # generating
    with engine_stopped(server):
        started = time.monotonic()
        with pytest.raises(openai.APIError, match=rf"no output for {IDLE_S:g} s \(idle_timeout_s"):
            for _ in pieces:  # what was already sent, then nothing
                pass
        waited = time.monotonic() - started
        time.sleep(0.5)  # the cancellation reaches Triton while its model is stopped
    assert IDLE_S - 0.5 < waited < IDLE_S + 10
    idle = wait_idle(server)  # no request running and no pages held once the engine resumes
    assert idle["icekv_requests_cancelled_total"] == before + 1  # cancelled, not run to its 1000 tokens
    answer = client_of(idle_limited).chat.completions.create(
        model="icekv", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert answer.choices[0].message.content  # the server serves on


def test_a_whole_request_limit_applies_where_one_is_set(total_limited, server):
    wait_idle(server)
    body = json.dumps({"model": "icekv", "messages": STORY, "max_tokens": 1000}).encode()
    request = urllib.request.Request(f"{total_limited.url}/v1/chat/completions", data=body)
    replies = queue.Queue()

    def send():
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                replies.put(answer.status)
        except urllib.error.HTTPError as e:
            replies.put(e)

    started = time.monotonic()
    threading.Thread(target=send, daemon=True).start()
    deadline = time.monotonic() + 60
    while metrics(server)["icekv_active_requests"] == 0:  # the engine holds it (a stopped stub refuses new ones)
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)
    with engine_stopped(server):  # so it cannot finish within the limit
        refused = replies.get(timeout=60)
        waited = time.monotonic() - started
        time.sleep(0.5)
    assert isinstance(refused, urllib.error.HTTPError), refused
    assert refused.code == 504 and TOTAL_S - 0.5 < waited < TOTAL_S + 10
    error = json.loads(refused.read())["error"]
    assert "took longer than 2 s (request_timeout_s)" in error["message"] and error["type"] == "timeout_error"
    wait_idle(server)
    short = json.dumps({"model": "icekv", "messages": STORY, "max_tokens": 4}).encode()
    with urllib.request.urlopen(urllib.request.Request(request.full_url, data=short), timeout=120) as answer:
        assert json.loads(answer.read())["choices"][0]["finish_reason"] in ("stop", "length")
